"""What makes disaggregation win, engine side: a busy engine answers at once, queue time
is counted from receipt, a short prompt does not wait behind a long prefill, D sends
its first token as soon as the KV is there, and ``min_tokens`` holds outputs open."""

from __future__ import annotations

import asyncio
import threading
import time

from pdserve.api.proto import engine_pb2
from pdserve.api.sampling import SamplingParams
from pdserve.engine.kv_transfer.params import KVTransferParams
from pdserve.engine.loop import EngineLoop
from pdserve.engine.server import EngineService
from tests.unit.engine.pd_harness import assert_all_free, make_engine, run_until_idle, tokens
from tests.unit.engine.test_scheduler_engine import (
    assert_no_leak,
    greedy,
    make_prompt,
    run_alone,
)
from tests.unit.engine.test_scheduler_engine import (
    make_engine as make_hybrid,
)


def test_a_long_prefill_is_chunked_and_a_short_prompt_arriving_during_it_goes_first():
    engine = make_hybrid(prefill_chunk_tokens=64, max_num_batched_tokens=512)
    long_prompt, short_prompt = make_prompt(400, seed=1), make_prompt(12, seed=2)
    long = engine.add_request("long", long_prompt, greedy(4))
    engine.step()
    assert long.num_computed_tokens == 64  # one chunk, not the whole prompt
    engine.add_request("short", short_prompt, greedy(4))
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["short"].new_token_ids, "the short prompt waited for the long one"
    assert "long" not in outputs and long.num_computed_tokens == 128 - 12  # the chunk, shared
    while engine.has_unfinished:
        engine.step()
    assert long.output_token_ids == run_alone(long_prompt, 4)
    assert_no_leak(engine)


def test_shortest_remaining_prefill_first_when_long_prompts_fill_the_budget():
    # Two long prompts already prefilling would take the whole budget; a short prompt
    # that arrives is still scheduled in the next step, ahead of both.
    engine = make_hybrid(prefill_chunk_tokens=64, max_num_batched_tokens=128)
    for i in range(2):
        engine.add_request(f"long-{i}", make_prompt(500, seed=10 + i), greedy(2))
    engine.step()
    engine.add_request("short", make_prompt(10, seed=3), greedy(2))
    batch = engine.scheduler.schedule()
    ids = [r.request_id for r, _ in batch.items]
    assert ids[0] == "short" and batch.num_tokens <= 64


def test_chunking_and_reordering_leave_greedy_outputs_unchanged():
    prompts = [make_prompt(n, seed=20 + n) for n in (300, 9, 150, 33)]
    engine = make_hybrid(prefill_chunk_tokens=32, max_num_batched_tokens=96)
    outs = engine.generate(prompts, greedy(6))
    assert outs == [run_alone(p, 6) for p in prompts]
    assert_no_leak(engine)


def test_min_tokens_keeps_a_stop_token_from_ending_the_output_early():
    engine = make_hybrid()
    prompt = make_prompt(16, seed=4)
    [free_run] = engine.generate([prompt], greedy(6))
    stop = free_run[0]
    [stopped] = engine.generate([prompt], SamplingParams(max_tokens=6, stop_token_ids=[stop]))
    assert stopped == [stop]
    held = SamplingParams(max_tokens=6, stop_token_ids=[stop], min_tokens=4)
    [out] = engine.generate([prompt], held)
    assert len(out) >= 4 and stop not in out[:4]
    assert_no_leak(engine)


class _SlowStep:
    """Wraps ``runner.execute`` so the first call blocks until released."""

    def __init__(self, runner) -> None:
        self.inner, self.entered, self.release = runner.execute, threading.Event(), threading.Event()
        runner.execute = self

    def __call__(self, *args, **kwargs):
        if not self.release.is_set():
            self.entered.set()
            self.release.wait(10)
        return self.inner(*args, **kwargs)


def test_a_busy_engine_answers_stats_at_once_and_queue_time_counts_from_receipt():
    engine = make_hybrid()
    slow = _SlowStep(engine.runner)
    loop = EngineLoop(engine)
    loop.start()
    outputs: dict[str, list] = {"first": [], "second": []}
    try:
        loop.submit("first", make_prompt(8, seed=5), None, greedy(2), outputs["first"].append)
        assert slow.entered.wait(10)
        loop.submit("second", make_prompt(8, seed=6), None, greedy(2), outputs["second"].append)
        started = time.monotonic()
        stats = asyncio.run(asyncio.wait_for(EngineService(loop).Stats(engine_pb2.StatsRequest(), None), 0.5))
        assert time.monotonic() - started < 0.5
        assert stats.num_waiting == 1  # the snapshot published when "first" was admitted
        time.sleep(0.3)  # "second" waits behind the blocked step
        slow.release.set()
        deadline = time.monotonic() + 10
        while not (outputs["second"] and outputs["second"][-1].finished):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        slow.release.set()
        loop.stop()
    first_timings = next(o.timings for o in outputs["second"] if o.timings)
    assert first_timings["queue_s"] >= 0.3


def test_decode_sends_its_first_token_without_running_a_step_first():
    p, d = make_engine("prefill"), make_engine("decode")
    calls = {"n": 0}
    inner = d.runner.execute

    def counting(*args, **kwargs):
        calls["n"] += 1
        return inner(*args, **kwargs)

    d.runner.execute = counting
    try:
        prompt = make_prompt(20, seed=7)
        xid = "x-1"
        d.add_request("d-1", prompt, greedy(4),
                      kv_transfer=KVTransferParams("decode", "layerwise", xid, p.connector.endpoint))
        p.add_request("p-1", prompt, greedy(4),
                      kv_transfer=KVTransferParams("prefill", "layerwise", xid, d.connector.endpoint))
        seen: dict = {}

        def on_outputs(engine, out):
            if engine is d and out.new_token_ids and "first" not in seen:
                seen["first"] = (calls["n"], out)

        outs = run_until_idle(p, d, on_outputs=on_outputs)
        num_calls, first = seen["first"]
        assert num_calls == 0, "D ran a model step before sending the first token"
        assert first.timings["decode_queue_s"] >= 0 and first.timings["kv_wait_s"] > 0
        assert len(tokens(outs["d-1"])) == 4
    finally:
        p.close()
        d.close()
    assert_all_free(p, d)
