"""Overload is backpressure: a D whose KV cache is full refuses a decode leg within its
reserve wait ("decode full"), tells P, and both legs end FINISHED_FULL with every block
free, while the request that holds D's blocks goes on untouched.

In-process P and D over TCP (``pd_harness``); D has 6 blocks of 8 tokens and each
prompt needs 5, so the second request cannot be reserved while the first holds them.
P's KV writes are delayed (fault injection) so the first one holds D's blocks longer
than D's reserve wait.
"""

from __future__ import annotations

import time

import pytest

from pdserve.api.sampling import SamplingParams
from pdserve.engine.metrics import attach_metrics
from pdserve.engine.request import RequestStatus
from tests.unit.engine.pd_harness import (
    assert_all_free,
    make_engine,
    run_until_idle,
    submit_pair,
    tokens,
)

FIRST, SECOND = list(range(1, 41)), list(range(100, 140))  # 5 blocks each
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
RESERVE_WAIT_S = 0.3
CHUNK = dict(max_num_batched_tokens=64)  # one prefill chunk: one write job per layer


@pytest.fixture(scope="module")
def reference():
    hybrid = make_engine("hybrid", transport="none", **CHUNK)
    return hybrid.generate([FIRST], PARAMS)[0]


def make_pair(reserve_wait_s: float, send_delay_s: float = 0.0):
    p = make_engine("prefill", fault_kv_send_delay_s=send_delay_s, **CHUNK)
    d = make_engine("decode", num_kv_blocks=6, kv_reserve_wait_s=reserve_wait_s, **CHUNK)
    return p, d


def run_and_time(p, d) -> tuple[dict, dict]:
    """Step both until idle; returns the outputs and when each request finished."""
    started_s = time.monotonic()
    ended_s: dict[str, float] = {}

    def on_output(engine, out):
        if out.finished:
            ended_s[out.request_id] = time.monotonic() - started_s

    return run_until_idle(p, d, on_outputs=on_output), ended_s


def assert_refused(outs, rid: str, peer: str) -> None:
    d_last, p_last = outs[f"d-{rid}"][-1], outs[f"p-{rid}"][-1]
    assert d_last.finish_reason == "full" and d_last.error.startswith("decode full: 5 KV blocks wanted"), d_last
    assert p_last.finish_reason == "full" and p_last.error == f"decode full (peer {peer})", p_last
    assert tokens(outs[f"d-{rid}"]) == []


@pytest.mark.parametrize("mode, send_delay_s", [("push", 1.0), ("layerwise", 0.4)])
def test_a_full_decode_refuses_within_its_reserve_wait(reference, mode, send_delay_s):
    p, d = make_pair(RESERVE_WAIT_S, send_delay_s)
    metrics = attach_metrics(d)
    try:
        submit_pair(p, d, "first", FIRST, PARAMS, mode)
        submit_pair(p, d, "second", SECOND, PARAMS, mode)
        outs, ended_s = run_and_time(p, d)

        assert_refused(outs, "second", d.connector.endpoint)
        assert ended_s["d-second"] < RESERVE_WAIT_S + 1.0  # not the 3-6 s deadlines
        assert ended_s["p-second"] < RESERVE_WAIT_S + 1.0
        assert ended_s["d-second"] < ended_s["d-first"]  # refused while the first held the blocks
        assert tokens(outs["d-first"]) == reference and outs["d-first"][-1].finish_reason == "length"
        assert outs["p-first"][-1].finish_reason == "handoff"
        for engine in (p, d):  # a refusal is not a failed transfer
            stats = engine.connector.transfer_stats
            assert (stats.num_ok, stats.num_failed, stats.num_refused) == (1, 0, 1)
        text = metrics.render(d.stats()).decode()
        assert 'pdserve_engine_kv_reserve_refused_total{role="decode"} 1.0' in text
        failures = f'pdserve_engine_kv_transfer_failures_total{{mode="{mode}",role="decode",transport="tcp"}}'
        assert f"{failures} 0.0" in text
        assert_all_free(p, d)
    finally:
        p.close()
        d.close()


def test_pull_refuses_when_ready_finds_no_blocks(reference):
    """Pull: D allocates on READY. Both READYs reach D in one step; with no wait at all
    the second is refused at once, and P frees the blocks it held for D to read."""
    p, d = make_pair(reserve_wait_s=0.0)
    try:
        submit_pair(p, d, "first", FIRST, PARAMS, "pull")
        submit_pair(p, d, "second", SECOND, PARAMS, "pull")
        first_tokens: dict[str, list] = {}
        deadline = time.monotonic() + 10
        while len(first_tokens) < 2:  # P alone: both prefilled, READY sent for each
            assert time.monotonic() < deadline
            for out in p.step():
                first_tokens.setdefault(out.request_id, out.new_token_ids)
        outs = run_until_idle(p, d)

        assert_refused(outs, "second", d.connector.endpoint)
        assert first_tokens["p-first"] == reference[:1]
        assert tokens(outs["d-first"]) == reference
        assert_all_free(p, d)
    finally:
        p.close()
        d.close()


def test_reserve_wait_must_stay_below_the_descriptor_timeout():
    from pdserve.engine.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="kv_reserve_wait_s must be at least 0 and below"):
        EngineConfig(kv_reserve_wait_s=10.0, kv_descriptor_timeout_s=10.0).validate()
    with pytest.raises(ConfigError, match="kv_reserve_wait_s"):
        EngineConfig(kv_reserve_wait_s=-1.0).validate()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_leg_its_client_aborts_cancels_the_transfer_and_is_no_failure(side):
    # What the Coordinator does when D refused a leg, its client left or a stop string
    # matched: it aborts the other leg. Both sides count a cancellation, not a failure.
    p, d = make_pair(reserve_wait_s=1.0, send_delay_s=0.5)
    try:
        submit_pair(p, d, "gone", FIRST, PARAMS, "layerwise")
        for _ in range(3):
            p.step(), d.step()
        (p if side == "prefill" else d).abort_request(f"{side[0]}-gone")
        if side == "decode":
            p.abort_request("p-gone")  # the Coordinator closes both legs of the attempt
        run_until_idle(p, d)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(
                e.connector.transfer_stats.num_cancelled == 0 for e in (p, d)):
            p.step(), d.step()
            time.sleep(0.01)
        for engine in (p, d):
            stats = engine.connector.transfer_stats
            assert (stats.num_failed, stats.num_cancelled) == (0, 1), (engine.config.role, stats)
        assert_all_free(p, d)
    finally:
        p.close()
        d.close()


LONG_WAITS = dict(kv_descriptor_timeout_s=10.0, kv_done_timeout_s=20.0)  # D may wait seconds for room


def references(prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[int]]:
    """Each prompt's tokens on a hybrid engine alone."""
    hybrid = make_engine("hybrid", transport="none")
    try:
        return dict(zip(prompts, hybrid.generate(list(prompts.values()), params), strict=True))
    finally:
        hybrid.close()


def decode_transfer(d, request_id: str):
    """D's live transfer of ``request_id``, if any."""
    return next((x for x in d.connector.decode.transfers.values() if x.request.request_id == request_id), None)


def step_both(p, d, outs: dict[str, list]) -> None:
    """One step of each engine, their outputs kept by request id."""
    for engine in (p, d):
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    time.sleep(0.0005)


def test_a_stream_preempted_on_a_full_decode_gets_its_blocks_back_before_a_new_transfer():
    """D has 10 blocks; two streams of 3-block prompts that grow to 6 blocks each: the
    later one is preempted. A third request arrives while it waits: its reservation
    must not take the blocks the preempted stream needs back (``owed_blocks``), or on a
    busy D new transfers take every block that frees up and the preempted stream starves
    until its client's idle deadline. All three end with the tokens they would alone."""
    p = make_engine("prefill", **LONG_WAITS)
    d = make_engine("decode", num_kv_blocks=10, kv_reserve_wait_s=5.0, **LONG_WAITS)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = {rid: list(range(base, base + 24)) for rid, base in (("a", 1), ("b", 50), ("c", 100))}
    try:
        reference = references(prompts, params)
        submit_pair(p, d, "a", prompts["a"], params, "push")
        submit_pair(p, d, "b", prompts["b"], params, "push")
        outs: dict[str, list] = {}

        def step() -> None:
            step_both(p, d, outs)

        def on_d(rid: str):
            return next((r for r in [*d.scheduler.waiting, *d.scheduler.running] if r.request_id == rid), None)

        deadline = time.monotonic() + 20
        while (b := on_d("d-b")) is None or b.status != RequestStatus.PREEMPTED:
            assert time.monotonic() < deadline, "b was never preempted"
            step()
        assert d.block_manager.owed_blocks >= d.block_manager.num_blocks_for(b.num_tokens) > 0
        submit_pair(p, d, "c", prompts["c"], params, "push")
        c_reserved_while_b_waited = False
        while p.has_unfinished or d.has_unfinished:
            assert time.monotonic() < deadline, "the engines did not finish"
            step()
            c = decode_transfer(d, "d-c")
            b = on_d("d-b")
            if c is not None and c.reserve_sent and b is not None and b.status == RequestStatus.PREEMPTED:
                c_reserved_while_b_waited = True
        assert not c_reserved_while_b_waited
        for rid in prompts:
            assert tokens(outs[f"d-{rid}"]) == reference[rid], rid
            assert outs[f"d-{rid}"][-1].finish_reason == "length"
        assert d.block_manager.owed_blocks == 0
        assert_all_free(p, d)
    finally:
        p.close()
        d.close()


def test_a_local_prefill_queued_on_a_decode_whose_slots_are_taken_starts_before_new_transfers():
    """D runs at most ``max_num_seqs`` = 2 streams. Two PD streams run; a short prompt the
    Coordinator sent to D itself (conditional disaggregation) queues for a slot; a third
    PD stream arrives. Its reservation must leave the slot to the queued request (else,
    as PD streams kept coming, the local one waited until its client's deadline), and D
    never runs more than two streams; a transfer that finds no slot within its reserve
    wait is refused as "decode full", load the Coordinator answers."""
    p = make_engine("prefill", **LONG_WAITS)
    d = make_engine("decode", max_num_seqs=2, kv_reserve_wait_s=5.0, **LONG_WAITS)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = {rid: list(range(base, base + 12)) for rid, base in (("a", 1), ("b", 30), ("c", 60), ("e", 90))}
    try:
        reference = references(prompts, params)
        submit_pair(p, d, "a", prompts["a"], params, "push")
        submit_pair(p, d, "b", prompts["b"], params, "push")
        outs: dict[str, list] = {}
        most_running = 0

        def step() -> None:
            nonlocal most_running
            step_both(p, d, outs)
            most_running = max(most_running, len(d.scheduler.running))

        deadline = time.monotonic() + 20
        while len(d.scheduler.running) < 2:
            assert time.monotonic() < deadline, "the two PD streams never ran"
            step()
        d.add_request("c", prompts["c"], params)  # local: prefilled on D
        submit_pair(p, d, "e", prompts["e"], params, "push")
        e_reserved_before_c_ran = False
        while p.has_unfinished or d.has_unfinished:
            assert time.monotonic() < deadline, "the engines did not finish"
            step()
            e = decode_transfer(d, "d-e")
            if e is not None and e.reserve_sent and "c" not in outs:
                e_reserved_before_c_ran = True
        assert not e_reserved_before_c_ran
        assert most_running == 2
        for rid in ("a", "b", "e"):
            assert tokens(outs[f"d-{rid}"]) == reference[rid], rid
        assert tokens(outs["c"]) == reference["c"]
        assert d.block_manager.owed_blocks == 0
        assert_all_free(p, d)
    finally:
        p.close()
        d.close()


def test_a_transfer_with_no_running_slot_within_its_reserve_wait_is_refused_as_decode_full():
    # D has blocks for both; its one running slot is the first's from its reservation
    # on (P's writes are delayed past the second's reserve wait).
    p = make_engine("prefill", fault_kv_send_delay_s=1.0, **CHUNK)
    d = make_engine("decode", max_num_seqs=1, kv_reserve_wait_s=RESERVE_WAIT_S, **CHUNK)
    params = PARAMS
    try:
        submit_pair(p, d, "first", FIRST, params, "push")
        submit_pair(p, d, "second", SECOND, params, "push")
        outs = run_until_idle(p, d)
        assert outs["d-first"][-1].finish_reason == "length"
        last = outs["d-second"][-1]
        assert last.finish_reason == "full" and last.error.startswith("decode full: every running slot taken")
        assert outs["p-second"][-1].finish_reason == "full"
        assert_all_free(p, d)
    finally:
        p.close()
        d.close()
