"""Generate calls and the engine loop racing: cancellation during admission, Abort.

The servicer runs in this test's event loop against a real ``EngineLoop`` on the tiny
engine. The loop thread is held at exact points (a blocking command, a slow
``add_request``) so that a call is cancelled before, or while, its request is being
admitted. Either way nothing is left running, no future is settled twice, and the
loop logs no error. Every request and block is gone at the end.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from pdserve.api.proto import engine_pb2 as pb
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loop import EngineLoop
from pdserve.engine.server import EngineService
from pdserve.runtime.engine_client import build_generate_request


class Context:
    """The part of grpc's ServicerContext that Generate uses on refusals."""

    async def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")


@pytest.fixture
def loop(caplog):
    caplog.set_level(logging.INFO)
    loop = EngineLoop(LLMEngine(EngineConfig(model="tiny", num_kv_blocks=64, block_size=8)))
    loop.start()
    yield loop
    assert loop.call(lambda e: (dict(e.requests), e.has_unfinished)).result(5) == ({}, False)
    assert loop.engine.block_manager.num_free_blocks == loop.engine.block_manager.num_blocks
    loop.stop()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def generate(loop: EngineLoop, rid: str, max_tokens: int = 1000):
    request = build_generate_request(rid, "", [1, 2, 3], max_tokens=max_tokens, ignore_eos=True)
    return EngineService(loop).Generate(request, Context())


def test_call_cancelled_before_the_loop_took_it_is_never_admitted(loop):
    gate = threading.Event()
    busy = loop.call(lambda e: gate.wait(10))  # the loop thread is stuck in a command

    async def go():
        first = asyncio.ensure_future(generate(loop, "early").__anext__())
        await asyncio.sleep(0.1)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first

    asyncio.run(go())
    gate.set()
    busy.result(5)
    assert loop.call(lambda e: "early" in e.requests).result(5) is False


def test_call_cancelled_while_being_admitted_ends_its_request(loop, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    add_request = loop.engine.add_request

    def slow_add(*args, **kwargs):
        entered.set()
        release.wait(10)
        return add_request(*args, **kwargs)

    monkeypatch.setattr(loop.engine, "add_request", slow_add)

    async def go():
        first = asyncio.ensure_future(generate(loop, "racing").__anext__())
        await asyncio.to_thread(entered.wait, 5)  # the loop thread is admitting it now
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        release.set()

    asyncio.run(go())
    # The abort queued by the cancelled call runs after the admission: nothing is left.
    assert loop.call(lambda e: "racing" in e.requests).result(5) is False


def test_abort_ends_the_stream_of_its_request_only(loop):
    async def go():
        service = EngineService(loop)
        stream = generate(loop, "victim")
        other = generate(loop, "bystander", max_tokens=20)
        first = await stream.__anext__()
        response = await service.Abort(pb.AbortRequest(request_id="victim"), Context())
        rest = await asyncio.wait_for(_collect(stream), timeout=10)
        return first, response.aborted, rest, await _collect(other)

    first, aborted, rest, other = asyncio.run(go())
    assert aborted and not first.finished
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert other[-1].finish_reason == "length" and sum(len(m.token_ids) for m in other) == 20


async def _collect(stream) -> list:
    return [m async for m in stream]
