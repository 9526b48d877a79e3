"""EngineClient's one-call health and stats, against an engine that predates it."""

import asyncio

from pdserve.api.proto import engine_pb2 as pb
from pdserve.runtime.engine_client import EngineClient


class OldStub:
    """An engine from before ``StatsRequest.with_health``: its Stats has no health."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def Stats(self, request, timeout=None, metadata=None):
        self.calls.append("Stats")
        return pb.StatsResponse(num_running=3)

    async def Health(self, request, timeout=None, metadata=None):
        self.calls.append("Health")
        return pb.HealthResponse(serving=True, role="decode")


class NewStub(OldStub):
    async def Stats(self, request, timeout=None, metadata=None):
        self.calls.append("Stats")
        answer = pb.StatsResponse(num_running=3)
        if request.with_health:
            answer.health.CopyFrom(pb.HealthResponse(serving=True, role="prefill"))
        return answer


def read(stub) -> tuple:
    async def go():
        client = EngineClient("127.0.0.1:1")
        client._stub = stub
        try:
            return await client.health_and_stats(1.0)
        finally:
            await client.close()
    return asyncio.run(go())


def test_an_engine_that_answers_both_is_asked_once():
    stub = NewStub()
    health, stats = read(stub)
    assert (health.role, stats.num_running, stub.calls) == ("prefill", 3, ["Stats"])


def test_an_engine_from_before_is_asked_for_its_health_too():
    stub = OldStub()
    health, stats = read(stub)
    assert (health.role, health.serving, stats.num_running) == ("decode", True, 3)
    assert stub.calls == ["Stats", "Health"]
