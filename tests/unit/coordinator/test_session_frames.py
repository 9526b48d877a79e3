"""The session port (runtime/frames.py, engine/session_server.FrameSessionServer) and
the Coordinator's end of it, against stub engines: the frames themselves, the engine
side driven by a raw connection (hello, batching, a malformed request ended alone),
peers that break the rules (no hello, a wrong token, a frame too long, garbage after
the hello) refused or cut off with nothing allocated for them and the engine serving
on, and the Coordinator's session refused, fed garbage, or over mutual TLS."""

from __future__ import annotations

import asyncio
import contextlib
import ssl

import grpc
import pytest

from pdserve.api.proto import engine_pb2 as pb
from pdserve.api.proto import engine_pb2_grpc as pb_grpc
from pdserve.coordinator.engine_errors import EngineFailed
from pdserve.coordinator.sessions import EmbeddedEngine
from pdserve.engine.session_server import FrameSessionServer
from pdserve.runtime import frames
from pdserve.runtime.engine_client import EngineClient
from pdserve.runtime.security import SecuritySettings, add_port
from tests.pki import make_pki
from tests.stub_engine import StubEngine, start_stub
from tests.unit.coordinator.test_sessions import (
    MIXED_BATCH,
    RaisingStub,
    check_mixed_batch,
    read_all,
    request,
    until,
)

TOKEN = "s3cret"


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


# -- the frames --------------------------------------------------------------------

def test_frames_split_whatever_the_reads_cut():
    stream = b"".join(frames.frame(p) for p in (b"one", b"", b"three" * 100, b"4"))
    for cut in (1, 2, 3, 5, 7, len(stream)):
        reader, got = frames.FrameReader(), []
        for start in range(0, len(stream), cut):
            got += [bytes(f) for f in reader.feed(stream[start:start + cut])]
        assert got == [b"one", b"", b"three" * 100, b"4"]


def test_a_frame_past_the_limit_is_refused_as_soon_as_its_header_is_in():
    reader = frames.FrameReader(max_bytes=10)
    assert reader.feed(frames.frame(b"x" * 10)) == [b"x" * 10]
    with pytest.raises(frames.FrameError, match="a frame of 1073741824 bytes"):
        reader.feed((1 << 30).to_bytes(4, "big"))  # not one of its bytes has come


def test_the_hello_carries_the_cluster_token():
    payload = frames.hello(TOKEN)[4:]
    assert frames.check_hello(payload, TOKEN) is None
    assert frames.check_hello(payload, None) is None  # a server without a token takes any
    assert frames.check_hello(frames.hello(None)[4:], TOKEN) == "no cluster token"
    assert frames.check_hello(frames.hello("guess")[4:], TOKEN) == "wrong cluster token"
    assert frames.check_hello(b"GET / HTTP/1.1", TOKEN) == "not a pdserve session"


# -- the engine side, driven by a raw connection -------------------------------------

@contextlib.asynccontextmanager
async def session_port(stub: StubEngine, token: str | None = TOKEN):
    """``stub``'s session port with ``token``; at the end, no session left open."""
    server = FrameSessionServer(stub, SecuritySettings(token=token))
    port = await server.start("127.0.0.1")
    try:
        yield server, port
    finally:
        await server.close()
    assert not server._connections


class RawPeer:
    """A peer speaking the wire by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int, hello: bytes | None = None) -> RawPeer:
        peer = cls(*await asyncio.open_connection("127.0.0.1", port))
        if hello is not None:
            peer.writer.write(hello)
        return peer

    def send(self, request: pb.SessionRequest) -> None:
        self.writer.write(frames.frame(request.SerializeToString()))

    async def frame(self) -> bytes:
        size = int.from_bytes(await self.reader.readexactly(4), "big")
        return await self.reader.readexactly(size)

    async def response(self) -> pb.SessionResponse:
        return pb.SessionResponse.FromString(await self.frame())

    async def closed(self) -> bool:
        """Whether the engine closed the connection (EOF or reset) within 2 s."""
        try:
            return await asyncio.wait_for(self.reader.read(), 2.0) == b""
        except ConnectionResetError:
            return True


def test_the_engine_side_batches_and_ends_a_malformed_request_alone():
    async def scenario():
        stub = RaisingStub(num_tokens=4)
        async with session_port(stub) as (server, port):
            peer = await RawPeer.connect(port, frames.hello(TOKEN))
            assert await peer.frame() == frames.OK
            peer.send(MIXED_BATCH)
            await check_mixed_batch(peer.response)
            # The client's side ends: the session ends once its requests have.
            peer.send(pb.SessionRequest(generate=[request("c")]))
            peer.writer.write_eof()
            got = []
            with contextlib.suppress(asyncio.IncompleteReadError):
                while True:
                    got.append(await peer.response())
            assert [e.request_id for r in got for e in r.ends] == ["c"]
            await until(lambda: not server._connections)
        assert not stub._inflight

    run(scenario)


@pytest.mark.parametrize("hello, reason", [
    (frames.hello("guess"), "wrong cluster token"),
    (frames.hello(None), "no cluster token"),
    (frames.frame(b"GET / HTTP/1.1\r\n"), "not a pdserve session"),
    ((1 << 30).to_bytes(4, "big"), "a frame of 1073741824 bytes"),  # and no more bytes sent
])
def test_a_peer_without_the_right_hello_is_refused_with_nothing_started(hello, reason):
    async def scenario():
        stub = StubEngine(num_tokens=2)
        async with session_port(stub) as (server, port):
            peer = await RawPeer.connect(port, hello)
            peer.send(pb.SessionRequest(generate=[request("sneaky")]))  # before any answer
            answer = await peer.frame()
            assert answer.startswith(frames.REFUSED) and reason in answer.decode()
            assert await peer.closed()
            assert not server._connections and not stub.request_ids
            # The engine serves the next peer as before.
            good = await RawPeer.connect(port, frames.hello(TOKEN))
            assert await good.frame() == frames.OK
            good.send(pb.SessionRequest(generate=[request("fine", 2)]))
            assert (await good.response()).messages[0].request_id == "fine"
            good.writer.close()

    run(scenario)


def test_a_peer_that_says_nothing_is_cut_off_at_the_hello_timeout(monkeypatch):
    monkeypatch.setattr(frames, "HELLO_TIMEOUT_S", 0.2)

    async def scenario():
        async with session_port(StubEngine()) as (server, port):
            silent = await RawPeer.connect(port)
            assert (await silent.frame()).startswith(frames.REFUSED + b"no hello in time")
            assert await silent.closed()

    run(scenario)


def test_garbage_after_the_hello_ends_that_session_alone():
    async def scenario():
        stub = StubEngine(num_tokens=200, token_delay_s=0.02)
        async with session_port(stub) as (server, port):
            other = await RawPeer.connect(port, frames.hello(TOKEN))
            assert await other.frame() == frames.OK
            bad = await RawPeer.connect(port, frames.hello(TOKEN))
            assert await bad.frame() == frames.OK
            bad.send(pb.SessionRequest(generate=[request("doomed", 200)]))
            await until(lambda: "doomed" in stub._inflight)
            bad.writer.write(frames.frame(b"\xff\xff\xff\xff not protobuf"))
            assert await bad.closed()
            await until(lambda: "doomed" not in stub._inflight)  # its request was cancelled
            other.send(pb.SessionRequest(generate=[request("alive", 2)]))
            assert (await other.response()).messages[0].request_id == "alive"
            other.writer.close()

    run(scenario)


# -- the Coordinator's end -------------------------------------------------------------

def test_a_session_the_engine_refuses_fails_its_requests_as_unavailable():
    async def scenario():
        stub = StubEngine(num_tokens=2)
        server, address = await start_stub(stub)
        async with session_port(stub) as (_, port):
            stub.session_port = port  # Health names a session port that wants TOKEN
            async with EngineClient(address, SecuritySettings(token="guess")) as client:
                session = EmbeddedEngine(client)
                with pytest.raises(EngineFailed) as info:
                    await read_all(session.generate(request("a"), 5.0))
                assert info.value.status == "UNAVAILABLE"
                assert "refused the session: wrong cluster token" in info.value.details
                assert session.num_calls == 0 and session.transport == ""
                await session.close()
        await server.stop(None)
        assert not stub.request_ids

    run(scenario)


def test_a_session_port_out_of_reach_fails_the_calls_and_the_next_request_reopens():
    async def scenario():
        stub = StubEngine(num_tokens=3)
        server, address = await start_stub(stub)
        good_port = stub.session_port
        closed = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0)
        stub.session_port = closed.sockets[0].getsockname()[1]
        closed.close()
        await closed.wait_closed()  # nothing listens there now
        async with EngineClient(address) as client:
            session = EmbeddedEngine(client)
            with pytest.raises(EngineFailed) as info:
                await read_all(session.generate(request("a", 3), 5.0))
            assert info.value.status == "UNAVAILABLE" and "unreachable" in info.value.details
            assert session.num_calls == 0 and session.transport == ""
            stub.session_port = good_port  # reachable again: the next request opens a session
            assert len(await read_all(session.generate(request("b", 3), 5.0))) == 3
            assert session.transport == "frames"
            await session.close()
        await server.stop(None)
        assert stub.request_ids == ["b"]

    run(scenario)


def test_an_engine_without_a_session_port_fails_the_calls_as_unavailable():
    async def scenario():
        stub = StubEngine(num_tokens=3)
        server, address = await start_stub(stub)
        stub.session_port = 0  # an engine that names none
        async with EngineClient(address) as client:
            session = EmbeddedEngine(client)
            with pytest.raises(EngineFailed) as info:
                await read_all(session.generate(request("a", 3), 5.0))
            assert "no session port" in info.value.details and session.num_calls == 0
            await session.close()
        await server.stop(None)
        assert not stub.request_ids

    run(scenario)


class GarbageEngine(asyncio.Protocol):
    """A session port that answers the hello, then sends a frame that is no SessionResponse."""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(frames.frame(frames.OK) + frames.frame(b"\xff\xff\xff\xff"))


def test_an_engine_sending_garbage_fails_the_calls_and_the_next_request_reopens():
    async def scenario():
        stub = StubEngine(num_tokens=3)
        server, address = await start_stub(stub)
        good_port = stub.session_port
        garbage = await asyncio.get_running_loop().create_server(GarbageEngine, "127.0.0.1", 0)
        stub.session_port = garbage.sockets[0].getsockname()[1]
        async with EngineClient(address) as client:
            session = EmbeddedEngine(client)
            with pytest.raises(EngineFailed) as info:
                await read_all(session.generate(request("a"), 5.0))
            assert info.value.status == "UNAVAILABLE"
            assert "malformed session frame" in info.value.details
            assert session.num_calls == 0
            stub.session_port = good_port
            assert len(await read_all(session.generate(request("b", 3), 5.0))) == 3
            assert session.transport == "frames"
            await session.close()
        garbage.close()
        await server.stop(None)

    run(scenario)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, SecuritySettings]:
    return make_pki(tmp_path_factory.mktemp("pki"), {
        "engine": "cluster-ca", "coordinator": "cluster-ca", "rogue": "rogue-ca"})


def test_sessions_over_mutual_tls(pki):
    async def scenario():
        stub = StubEngine(num_tokens=3)
        grpc_server = grpc.aio.server()
        pb_grpc.add_EngineServicer_to_server(stub, grpc_server)
        address = f"127.0.0.1:{add_port(grpc_server, '127.0.0.1:0', pki['engine'])}"
        await grpc_server.start()
        sessions = FrameSessionServer(stub, pki["engine"])
        stub.session_port = await sessions.start("127.0.0.1")
        async with EngineClient(address, pki["coordinator"]) as client:
            session = EmbeddedEngine(client)
            assert len(await read_all(session.generate(request("a", 3), 5.0))) == 3
            assert session.transport == "frames"
            await session.close()
        # A client whose certificate another CA signed, and one with none, are refused
        # at the handshake: no hello is read, no session made.
        rogue = frames.ssl_context(pki["rogue"], server=False)
        rogue.check_hostname, rogue.verify_mode = False, 0  # it does not check the engine either
        for context in (rogue, _without_certificate(pki["coordinator"].tls_ca)):
            with contextlib.suppress(ConnectionError, OSError, asyncio.IncompleteReadError):
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", stub.session_port, ssl=context, server_hostname="127.0.0.1")
                writer.write(frames.hello(None))
                assert await reader.read() == b""
            assert not sessions._connections and stub.request_ids == ["a"]
        await sessions.close()
        await grpc_server.stop(None)

    run(scenario)


def _without_certificate(ca: str) -> ssl.SSLContext:
    return ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
