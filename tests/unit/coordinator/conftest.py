"""Fixtures of the Coordinator's tests over real HTTP: the event loop thread and stub engines."""

from __future__ import annotations

import pytest

from tests.stub_engine import StubEngine, start_stub
from tests.unit.coordinator.harness import LoopThread


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def stubs(loop):
    """``stubs(**StubEngine kwargs)`` serves one stub engine and returns its address;
    ``stubs.by_address[address]`` is the stub (what it was sent)."""
    servers = []

    def make(**kwargs) -> str:
        stub = StubEngine(**kwargs)
        server, address = loop.run(start_stub(stub))
        servers.append(server)
        make.by_address[address] = stub
        return address

    make.by_address = {}
    yield make
    for server in servers:
        loop.run(server.stop(grace=None))
