"""Moves on real engine processes (simulated: the real scheduler, block manager,
preemption and KV handshake, no weights). Streams sent to the one decode engine
there is overflow its cache: it preempts them and queues the rest. A second decode
engine comes up; the Coordinator moves the streams stalled in the first one's queue
to it, and every stream ends whole: no error, no token lost or repeated."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx

from pdserve.coordinator.app import create_app
from pdserve.coordinator.settings import CoordinatorSettings
from pdserve.engine.sim import SIM_TEXT
from pdserve.runtime.engine_client import EngineClient
from tests.etcd import free_port
from tests.procs import PDSERVE, Proc
from tests.unit.coordinator.harness import AppServer

NUM_STREAMS, MAX_TOKENS = 8, 120
# 24 blocks of 16 tokens hold two or three of the streams at their longest (~10 blocks).
SIM = ["--simulate", "--model", "small", "--kv-transport", "tcp", "--block-size", "16",
       "--num-kv-blocks", "24"]


# The busy decode engine steps at 40 ms (the model's ~13): its queue lasts ~20 s, so on a
# loaded machine the late engine's start (seconds) still comes before it drains.
SLOW_DECODE = ["--sim-decode-base-ms", "40"]


def engine(role: str, port: int = 0, *extra: str) -> Proc:
    return Proc([*PDSERVE, "engine", *SIM, *extra, "--role", role, "--port", str(port)])


def address(proc: Proc) -> str:
    return proc.wait_for(r"serving model .* on (\S+:\d+)", 60).group(1)


def stats(addr: str):
    async def go():
        async with EngineClient(addr) as client:
            return await client.stats()
    return asyncio.run(go())


def complete(url: str, i: int) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "small", "prompt": f"stream {i}: " + "tell me more " * 3, "max_tokens": MAX_TOKENS})
    assert r.status_code == 200, r.text
    return r.json()


def test_streams_queued_on_a_full_decode_engine_move_to_a_new_one_and_end_whole(loop):
    prefill, busy = engine("prefill"), engine("decode", 0, *SLOW_DECODE)
    late_port = free_port()
    late = None
    try:
        addrs = [address(prefill), address(busy), f"127.0.0.1:{late_port}"]  # the last: not up yet
        settings = CoordinatorSettings(model="small", engines=tuple(addrs), block_size=16,
                                       poll_interval_s=0.2, move_stalled_s=0.5)
        with AppServer(loop, create_app(settings)) as app, ThreadPoolExecutor(NUM_STREAMS) as pool:
            answers = [pool.submit(complete, app.url, i) for i in range(NUM_STREAMS)]
            for _ in range(200):  # until the one decode engine queues what it cannot hold
                s = stats(addrs[1])
                if s.num_waiting and s.num_preemptions:
                    break
                assert not any(a.done() for a in answers)
                loop.run(asyncio.sleep(0.05))
            else:
                raise AssertionError(f"the decode engine never queued: {s}")
            late = engine("decode", late_port)
            address(late)
            texts = [a.result(120)["choices"][0]["text"] for a in answers]
            moves = app.deps.metrics.registry.get_sample_value("pdserve_coordinator_moves_total")
        assert texts == [(SIM_TEXT * 4)[:MAX_TOKENS]] * NUM_STREAMS  # whole, where it moved or not
        assert moves >= 1
        # The new engine got streams only by moves: every request was sent before it was up.
        assert stats(addrs[2]).num_generation_tokens_total > 0
    finally:
        for proc in (prefill, busy, late):
            if proc is not None:
                proc.stop()
