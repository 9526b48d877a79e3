"""The prefix index built from the engines' KV events, end to end: a real engine
process, Coordinators on it. The index equals what the engine's cache holds (after
evictions too), a new Coordinator has the same index at once, an engine restart
empties it, and the hit rate the index predicted is counted beside the hits the
engine reported."""

from __future__ import annotations

import time

import httpx

from pdserve.runtime.block_hash import hash_chain
from pdserve.runtime.engine_client import EngineClient
from tests.procs import start_engine
from tests.unit.coordinator.harness import metric, serve

BLOCK = 8
PROMPT = list(range(1, 33))  # four full blocks


async def _engine_holds(address: str) -> set[bytes]:
    async with EngineClient(address) as client:
        stream = client.kv_events()
        async for batch in stream:
            stream.cancel()
            return set(batch.stored)
    raise AssertionError("no snapshot")


def _index(app, address: str) -> set[bytes]:
    index = app.deps.router.index
    assert index.is_published(address)
    return set(index._published[address])


def _until(check, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _complete(app, prompt: list[int]) -> dict:
    r = httpx.post(app.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_index_follows_the_engines_cache_across_coordinator_and_engine_restarts(loop):
    proc, address = start_engine("--num-kv-blocks", "8", "--block-size", str(BLOCK))
    port = address.rsplit(":", 1)[1]
    try:
        with serve(loop, [address], model="tiny", block_size=BLOCK) as app:
            _until(lambda: _index(app, address) == set())
            _complete(app, PROMPT)
            holds = loop.run(_engine_holds(address))
            assert set(hash_chain(PROMPT, BLOCK)) <= holds
            _until(lambda: _assert_equal(_index(app, address), holds))
            again = _complete(app, PROMPT)
            reported = metric(app, "pdserve_coordinator_prefix_reported_tokens_total")
            predicted = metric(app, "pdserve_coordinator_prefix_predicted_tokens_total")
            assert reported == again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert predicted == reported  # the index predicted exactly the engine's hits
            # Other prompts evict the first: 8 blocks hold two prompts' worth at most.
            for base in (100, 150, 200):
                _complete(app, list(range(base, base + 32)))
            holds = loop.run(_engine_holds(address))
            assert not set(hash_chain(PROMPT, BLOCK)) <= holds
            _until(lambda: _assert_equal(_index(app, address), holds))
            # A new Coordinator knows the same at once (the engine's snapshot).
            with serve(loop, [address], model="tiny", block_size=BLOCK) as fresh:
                _until(lambda: _assert_equal(_index(fresh, address), holds))
            # The engine restarts at the same address: its cache, and the index, start empty.
            assert proc.stop() in (0, -15)
            proc, address2 = start_engine("--num-kv-blocks", "8", "--block-size", str(BLOCK),
                                          "--port", port)
            assert address2 == address
            _until(lambda: _assert_equal(_index(app, address), set()), timeout_s=20)
    finally:
        proc.stop()


def _assert_equal(a, b):
    assert a == b
    return a
