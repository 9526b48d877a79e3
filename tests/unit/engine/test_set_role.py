"""A role switch in place (``LLMEngine.set_role``): the engine takes the new role's legs
at once, while the legs in flight finish in the role they were admitted in; a leg of the
old role sent just after the switch (a Coordinator's view a heartbeat old) is still
served, and later one is refused as unavailable, for another engine to take, not as
bad input.

In-process engines over TCP (``pd_harness``), token ids checked against a hybrid
engine's.
"""

from __future__ import annotations

import time

import pytest

from pdserve.api.sampling import SamplingParams
from pdserve.engine.admission import EngineUnavailable
from pdserve.engine.kv_transfer.params import KVTransferParams
from tests.unit.engine.pd_harness import (
    assert_all_free,
    make_engine,
    run_until_idle,
    submit_pair,
    tokens,
)

FIRST, SECOND = list(range(1, 41)), list(range(100, 140))
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def test_a_decode_engine_switched_to_prefill_ends_its_streams_and_prefills_at_once():
    hybrid = make_engine("hybrid", transport="none")
    try:
        reference = hybrid.generate([FIRST, SECOND], PARAMS)
    finally:
        hybrid.close()
    p, d, other = make_engine("prefill"), make_engine("decode"), make_engine("decode")
    try:
        switch_with_a_stream_in_flight(p, d, other, reference)
    finally:
        for engine in (p, d, other):
            engine.close()


def switch_with_a_stream_in_flight(p, d, other, reference) -> None:
    submit_pair(p, d, "first", FIRST, PARAMS, "push")
    outs: dict[str, list] = {}
    deadline = time.monotonic() + 20
    while len(tokens(outs.get("d-first", []))) < 2:  # d streams the first request
        assert time.monotonic() < deadline, "d never streamed"
        for engine in (p, d):
            for out in engine.step():
                outs.setdefault(out.request_id, []).append(out)

    d.set_role("prefill")  # with its stream in flight
    assert d.config.role == "prefill" and d.has_unfinished
    submit_pair(d, other, "second", SECOND, PARAMS, "push")  # d prefills for another D now
    submit_pair(p, d, "straggler", SECOND, PARAMS, "push")  # routed by a view not yet told

    for rid, more in run_until_idle(p, d, other).items():
        outs.setdefault(rid, []).extend(more)
    for rid in ("d-first", "d-second", "d-straggler"):
        assert outs[rid][-1].finish_reason == "length", outs[rid][-1]
    assert tokens(outs["d-first"]) == reference[0]
    assert tokens(outs["d-second"]) == reference[1] == tokens(outs["d-straggler"])
    assert outs["p-second"][-1].finish_reason == "handoff"
    # once the grace is over, a decode leg is no longer taken
    d._old_role_until = time.monotonic()
    with pytest.raises(EngineUnavailable, match="takes no decode leg"):
        d.add_request("d-late", SECOND, PARAMS,
                      kv_transfer=KVTransferParams("decode", "push", "x-late", p.connector.endpoint))
    assert_all_free(p, d, other)


def test_a_role_needs_a_known_name_and_a_kv_transport():
    hybrid = make_engine("hybrid", transport="none")
    try:
        with pytest.raises(ValueError, match="needs a KV transport"):
            hybrid.set_role("decode")
        with pytest.raises(ValueError, match="role must be"):
            hybrid.set_role("mixed")
        assert hybrid.config.role == "hybrid"
    finally:
        hybrid.close()
