"""Disaggregated prefill/decode: every mode over every transport equals one hybrid engine.

P and D are two engines in this process talking over real transports (sockets,
shared memory, Mooncake over TCP, NIXL over UCX); the harness steps them by hand so
the test can read D's KV at the moment the request is exposed.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.api.sampling import SamplingParams
from tests.unit.engine.pd_harness import (
    MODES,
    TRANSPORTS,
    assert_all_free,
    make_engine,
    prompt_kv,
    run_until_idle,
    submit_pair,
    tokens,
)

PROMPTS = [list(range(1, 60)), [7, 7, 3, 9, 250, 11, 5, 90, 91, 92, 93], list(range(200, 240))]


@pytest.fixture(scope="module")
def hybrid():
    # Same chunking as P (max_num_batched_tokens), so its KV is bit-identical to P's.
    return make_engine("hybrid", transport="none")


@pytest.fixture(params=TRANSPORTS, scope="module")
def transport(request):
    return request.param


@pytest.fixture(scope="module")
def pair(transport):
    p, d = make_engine("prefill", transport), make_engine("decode", transport)
    yield p, d
    p.close()
    d.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_disaggregated_output_equals_hybrid(pair, hybrid, transport, mode, sampled):
    p, d = pair
    params = SamplingParams(max_tokens=12, ignore_eos=True,
                            temperature=0.8 if sampled else 0.0, seed=42 if sampled else None)
    expected = hybrid.generate(PROMPTS, params)
    exposed_kv, sent_kv = {}, {}

    def capture(engine, out):
        # P's first output: its blocks hold exactly the KV it is about to send.
        # D's first output is the moment of exposure: its KV must be complete.
        if out.num_output_tokens != 1 or out.finished:
            return
        if engine is p:
            req = p.requests[out.request_id]
            sent_kv[out.request_id[2:]] = prompt_kv(p, req.block_table, req.num_prompt_tokens)
        else:
            req = next(r for r in d.scheduler.running if r.request_id == out.request_id)
            exposed_kv[out.request_id[2:]] = prompt_kv(d, req.block_table, req.num_prompt_tokens)

    for i, prompt in enumerate(PROMPTS):
        submit_pair(p, d, f"{mode}-{sampled}-{i}", prompt, params, mode)
    outs = run_until_idle(p, d, on_outputs=capture)
    for i, prompt in enumerate(PROMPTS):
        rid = f"{mode}-{sampled}-{i}"
        p_outs, d_outs = outs[f"p-{rid}"], outs[f"d-{rid}"]
        assert d_outs[-1].finish_reason == "length", d_outs[-1]
        assert tokens(d_outs) == expected[i]
        assert tokens(p_outs) == expected[i][:1]  # P reports the first token, then hands off
        assert p_outs[-1].finish_reason == "handoff"
        # D decoded from exactly the bytes P computed, which are what an engine
        # computes for this prompt (up to float rounding of a different batch shape).
        assert torch.equal(exposed_kv[rid], sent_kv[rid])
        torch.testing.assert_close(exposed_kv[rid], hybrid_prompt_kv(hybrid, prompt),
                                   atol=1e-5, rtol=1e-5)
    assert_all_free(p, d)
    stats = p.stats() if mode != "pull" else d.stats()
    assert stats.kv_transport == transport
    assert stats.kv_transfer_bytes > 0


def hybrid_prompt_kv(engine, prompt):
    rid = f"kv-{id(prompt)}"
    req = engine.add_request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    while not req.output_token_ids:
        engine.step()
    kv = prompt_kv(engine, req.block_table, len(prompt))
    engine.abort_request(rid)
    return kv
