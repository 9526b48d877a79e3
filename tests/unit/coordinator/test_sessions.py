"""The Coordinator's session to an engine (frames on its session port), against stub
engines: requests on one connection kept apart by id, one request's error, cancel or deadline leaving the
others running, an engine gone failing every request on it and a new session
opened for the next, and the engine side (engine/session_server.py) batching
messages and ending a malformed request alone. Each script ends with a leak check:
no call left in the session, no request left on the stub."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from pdserve.api.proto import engine_pb2 as pb
from pdserve.api.proto import engine_pb2_grpc as pb_grpc
from pdserve.coordinator.engine_errors import (
    CallCancelled,
    DeadlinePassed,
    EngineBusy,
    EngineCallError,
    EngineFailed,
    InputRefused,
)
from pdserve.coordinator.sessions import EmbeddedEngine
from pdserve.engine.session_server import FrameSessionServer
from pdserve.runtime.engine_client import EngineClient, build_generate_request
from tests.stub_engine import StubEngine, start_stub


def request(rid: str, max_tokens: int = 4, **kwargs) -> pb.GenerateRequest:
    return build_generate_request(rid, prompt_token_ids=[1, 2, 3], max_tokens=max_tokens, **kwargs)


async def read_all(call) -> list[pb.GenerateResponse]:
    return [message async for message in call]


async def until(predicate, timeout_s: float = 2.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(poll(), timeout_s)


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


@contextlib.asynccontextmanager
async def session_on(stub: StubEngine):
    """A session to ``stub`` served on a free port; at the end, the leak check: no call left in the session, no request
    left on the stub."""
    server, address = await start_stub(stub)
    client = EngineClient(address)
    session = EmbeddedEngine(client)
    try:
        yield session
        assert session.transport in ("", "frames")
        await until(lambda: not stub._inflight)
        assert session.num_calls == 0
    finally:
        await session.close()
        await client.close()
        await server.stop(grace=None)


async def error_of(call) -> EngineCallError:
    with pytest.raises(EngineCallError) as info:
        await read_all(call)
    return info.value


def test_two_requests_on_one_session_get_their_own_messages():
    async def scenario():
        stub = StubEngine(num_tokens=6, token_delay_s=0.01)
        async with session_on(stub) as session:
            a, b = session.generate(request("a", 3), 10.0), session.generate(request("b", 5), 10.0)
            got_a, got_b = await asyncio.gather(read_all(a), read_all(b))
            assert [m.request_id for m in got_a] == ["a"] * 3 and got_a[-1].finished
            assert [m.num_output_tokens for m in got_b] == [1, 2, 3, 4, 5] and got_b[-1].finished
            assert {m.request_id for m in got_b} == {"b"} and stub.max_inflight == 2
            first = session._link
            assert len(await read_all(session.generate(request("c"), 10.0))) == 4
            assert session._link is first  # one stream for all three

    run(scenario)


def test_one_requests_error_ends_it_alone():
    async def scenario():
        async with session_on(StubEngine(num_tokens=4, token_delay_s=0.02)) as session:
            good = session.generate(request("good"), 10.0)
            bad = session.generate(request("bad", kv_transfer={  # the stub refuses its long id
                "role": "decode", "mode": "push", "transfer_id": "x" * 200, "peer": "p:1"}), 10.0)
            error = await error_of(bad)
            assert isinstance(error, InputRefused) and "transfer_id" in error.details
            assert len(await read_all(good)) == 4
            assert len(await read_all(session.generate(request("after"), 10.0))) == 4

    run(scenario)


def test_a_full_engine_answers_full_on_the_session():
    async def scenario():
        async with session_on(StubEngine(behavior="full", num_full=1)) as session:
            error = await error_of(session.generate(request("first"), 10.0))
            assert isinstance(error, EngineBusy) and error.status == "RESOURCE_EXHAUSTED"
            assert error.details.startswith("prefill full")
            assert len(await read_all(session.generate(request("second"), 10.0))) == 1

    run(scenario)


def test_cancel_of_one_request_leaves_the_other_running():
    async def scenario():
        stub = StubEngine(num_tokens=500, token_delay_s=0.02)  # "a" alone would take 10 s
        async with session_on(stub) as session:
            a, b = session.generate(request("a", 500), 10.0), session.generate(request("b", 5), 10.0)
            assert (await a.__anext__()).request_id == "a"
            assert a.cancel() and not a.cancel()
            await until(lambda: "a" not in stub._inflight)  # its Generate was cancelled
            assert [m.num_output_tokens for m in await read_all(b)] == [1, 2, 3, 4, 5]
            assert isinstance(await error_of(a), CallCancelled)

    run(scenario)


def test_a_deadline_fails_its_request_and_cancels_it_on_the_engine():
    async def scenario():
        async with session_on(StubEngine(num_tokens=500, token_delay_s=0.05)) as session:
            slow = session.generate(request("slow", 500), 0.2)  # 25 s left alone
            quick = session.generate(request("quick", 2), 10.0)
            assert isinstance(await error_of(slow), DeadlinePassed)
            assert len(await read_all(quick)) == 2

    run(scenario)


def test_an_engine_gone_fails_its_requests_and_the_next_request_reopens():
    async def scenario():
        stub = StubEngine(num_tokens=50, token_delay_s=0.05)
        server, address = await start_stub(stub)
        async with EngineClient(address) as client:
            session = EmbeddedEngine(client)
            calls = [session.generate(request(rid, 50), 10.0) for rid in ("a", "b")]
            for call in calls:
                await call.__anext__()
            await server.stop(grace=None)  # the engine goes away mid-stream
            for call in calls:
                error = await error_of(call)
                assert isinstance(error, EngineFailed) and error.status in ("UNAVAILABLE",
                                                                            "CANCELLED")
            assert session.num_calls == 0 and session._link is None
            # The engine is back on its address: the next request opens a new session.
            server = grpc.aio.server()
            back = StubEngine(num_tokens=3)
            pb_grpc.add_EngineServicer_to_server(back, server)
            port = int(address.rsplit(":", 1)[1])
            assert server.add_insecure_port(f"127.0.0.1:{port}") == port
            await server.start()
            sessions = FrameSessionServer(back)
            back.session_port = await sessions.start("127.0.0.1")
            got = []
            for attempt in range(20):  # the channel reconnects with backoff
                try:
                    got = await read_all(session.generate(request(f"c{attempt}", 3), 10.0))
                    break
                except EngineFailed:
                    await asyncio.sleep(0.1)
            assert len(got) == 3 and session.num_calls == 0
            assert session.transport == "frames"
            await session.close()
        await sessions.close()
        await server.stop(grace=None)

    run(scenario)


def test_a_session_closed_by_the_coordinator_aborts_its_requests_on_the_engine():
    async def scenario():
        stub = StubEngine(num_tokens=500, token_delay_s=0.05)  # 25 s left alone
        async with session_on(stub) as session:
            calls = [session.generate(request(rid, 500), 10.0) for rid in ("a", "b")]
            for call in calls:
                await call.__anext__()
            assert sorted(stub._inflight) == ["a", "b"]
            await session.close()  # the leak check waits for the stub to have none left

    run(scenario)


class RaisingStub(StubEngine):
    """Generate raises on a prompt of one token (a bug an input triggers)."""

    async def Generate(self, request, context):
        if len(request.prompt_token_ids) == 1:
            raise RuntimeError("a bug")
        async for message in super().Generate(request, context):
            yield message


# Two good requests, one without an id, one whose Generate raises (``RaisingStub``).
MIXED_BATCH = pb.SessionRequest(generate=[
    request("a"), request("b"), pb.GenerateRequest(prompt_token_ids=[1]),
    build_generate_request("bug", prompt_token_ids=[7])])


async def check_mixed_batch(read_response) -> None:
    """The engine's answers to ``MIXED_BATCH`` (``read_response()``: its next
    SessionResponse): each request ended alone, the messages ready at once batched."""
    messages, ends, num_responses = [], {}, 0
    while len(ends) < 4:
        response = await read_response()
        num_responses += 1
        messages += response.messages
        ends.update((e.request_id, (e.code, e.details)) for e in response.ends)
    assert ends[""][0] == grpc.StatusCode.INVALID_ARGUMENT.value[0]  # no request id
    assert ends["bug"][0] == grpc.StatusCode.UNKNOWN.value[0] and "a bug" in ends["bug"][1]
    assert ends["a"] == ends["b"] == (0, "")
    assert [m.request_id for m in messages].count("a") == 4
    assert num_responses < len(messages)  # the messages ready at once share a response
