"""ProbePeer between real engines over tcp: a P asks its connector to check a D's KV
endpoint (handshake + one test read), served by the engine's gRPC service while both
engines run their own loop threads, the D idle (woken by the PROBE itself)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from pdserve.api.proto import engine_pb2_grpc as pb_grpc
from pdserve.engine.loop import EngineLoop
from pdserve.engine.server import EngineService
from pdserve.runtime.engine_client import EngineClient
from pdserve.runtime.security import SecuritySettings

from .pd_harness import assert_all_free, make_engine


@pytest.fixture
def running():
    """Start engines on their own loop threads; stop them (and check for leaks) after."""
    loops: list[EngineLoop] = []

    def start(role: str, **overrides) -> EngineLoop:
        loop = EngineLoop(make_engine(role, **overrides))
        loop.start()
        loops.append(loop)
        return loop

    yield start
    for loop in loops:
        loop.stop()
    assert_all_free(*(loop.engine for loop in loops))


def probe(p: EngineLoop, endpoint: str, test_transfer: bool, timeout_s: float = 3.0):
    """The ProbePeer RPC against ``p`` served in-process."""

    async def go():
        server = grpc.aio.server()
        pb_grpc.add_EngineServicer_to_server(EngineService(p), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with EngineClient(f"127.0.0.1:{port}", SecuritySettings()) as client:
                return await client.probe_peer(endpoint, test_transfer, timeout_s)
        finally:
            await server.stop(0)

    return asyncio.run(go())


def test_probe_with_a_test_transfer_passes_between_a_real_p_and_d(running):
    p, d = running("prefill"), running("decode")
    result = probe(p, d.engine.connector.endpoint, test_transfer=True)
    assert result.ok, result.reason
    assert result.peer_compat_hash == result.compat_hash == d.engine.connector.layout.compat_hash
    assert result.transport == "tcp"
    assert result.transfer_bytes == d.engine.connector.layout.block_bytes
    assert 0 < result.handshake_s < 1.0, "an idle D answers at once, not at its next request"
    assert result.transfer_s > 0


def test_probe_of_a_dead_endpoint_fails_saying_it_cannot_be_reached(running):
    p = running("prefill")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
    result = probe(p, dead, test_transfer=True, timeout_s=2.0)
    assert not result.ok
    assert f"cannot reach KV endpoint {dead}" in result.reason


def test_probe_of_a_layout_incompatible_peer_fails_naming_the_difference(running):
    p, d = running("prefill"), running("decode", block_size=16)
    result = probe(p, d.engine.connector.endpoint, test_transfer=True)
    assert not result.ok
    assert "incompatible KV layout" in result.reason and "block_size: 16 vs 8" in result.reason
    assert result.transfer_bytes == 0


def test_probe_needs_a_kv_transport(running):
    h = running("hybrid", transport="none")
    result = probe(h, "127.0.0.1:1", test_transfer=False)
    assert not result.ok and "no KV transport" in result.reason
