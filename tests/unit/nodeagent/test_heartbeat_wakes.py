"""The agent's heartbeat loop against a fake Controller: a wake-up (a command done, a
peer list checked) sends a heartbeat at once, and a burst of wake-ups (each prefill
engine's checks finishing in turn) sends them at most one per quarter interval."""

from __future__ import annotations

import asyncio
import time

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.nodeagent.agent import Agent, AgentSettings
from pdserve.runtime.security import SecuritySettings
from tests.unit.coordinator.harness import serve_controller

INTERVAL_S = 2.0


class CountingController(pb_grpc.ControllerServicer):
    def __init__(self) -> None:
        self.times: list[float] = []

    async def Heartbeat(self, request, context):
        self.times.append(time.monotonic())
        return pb.HeartbeatResponse(heartbeat_interval_s=INTERVAL_S)


def test_a_burst_of_wake_ups_is_one_heartbeat_per_quarter_interval():
    async def go():
        fake = CountingController()
        server, port = await serve_controller(fake)
        agent = Agent(AgentSettings(controllers=(f"127.0.0.1:{port}",), interval_s=INTERVAL_S), [],
                      SecuritySettings())
        loop = asyncio.create_task(agent._heartbeat_loop())
        try:
            while not fake.times:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            woken = time.monotonic()
            agent._wake.set()  # one wake-up: a heartbeat at once, not after the interval
            while len(fake.times) < 2:
                await asyncio.sleep(0.01)
            assert fake.times[1] - woken < INTERVAL_S / 4 + 0.2
            for _ in range(20):  # a burst over 0.4 s
                agent._wake.set()
                await asyncio.sleep(0.02)
            await asyncio.sleep(INTERVAL_S / 4 + 0.2)
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            await agent.stop()
            await server.stop(grace=None)
        gaps = [b - a for a, b in zip(fake.times, fake.times[1:], strict=False)]
        assert 3 <= len(fake.times) <= 4, fake.times  # the burst: one or two, not twenty
        assert min(gaps[1:]) >= INTERVAL_S / 4 - 0.01, gaps

    asyncio.run(go())
