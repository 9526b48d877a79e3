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


async def stop(loop: asyncio.Task, agent: Agent, server) -> None:
    loop.cancel()
    await asyncio.gather(loop, return_exceptions=True)
    await agent.stop()
    await server.stop(grace=None)


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
            await stop(loop, agent, server)
        gaps = [b - a for a, b in zip(fake.times, fake.times[1:], strict=False)]
        assert 3 <= len(fake.times) <= 4, fake.times  # the burst: one or two, not twenty
        assert min(gaps[1:]) >= INTERVAL_S / 4 - 0.01, gaps

    asyncio.run(go())


class SlowController(CountingController):
    """Answers each heartbeat after ``delay_s``: a busy Controller, or a busy agent host."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    async def Heartbeat(self, request, context):
        self.times.append(time.monotonic())
        await asyncio.sleep(self.delay_s)
        return pb.HeartbeatResponse(heartbeat_interval_s=1.0)


def test_a_slow_answer_does_not_stretch_the_interval():
    """Heartbeats start an interval apart, not an interval after the last answer: with
    answers 0.6 s late, every 1.0 s, not every 1.6 s (three missed intervals make an
    instance SUSPECT, so a stretched interval turns a slow host's instances SUSPECT)."""
    async def go():
        fake = SlowController(delay_s=0.6)
        server, port = await serve_controller(fake)
        agent = Agent(AgentSettings(controllers=(f"127.0.0.1:{port}",), interval_s=1.0), [],
                      SecuritySettings())
        loop = asyncio.create_task(agent._heartbeat_loop())
        try:
            while len(fake.times) < 5:
                await asyncio.sleep(0.02)
        finally:
            await stop(loop, agent, server)
        gaps = [b - a for a, b in zip(fake.times, fake.times[1:], strict=False)]
        assert sum(gaps) / len(gaps) < 1.25, gaps

    asyncio.run(go())


class ShorterIntervalController(CountingController):
    async def Heartbeat(self, request, context):
        self.times.append(time.monotonic())
        return pb.HeartbeatResponse(heartbeat_interval_s=0.3)


def test_the_agent_takes_the_interval_the_controller_gives():
    """The leader judges silence by the interval it tells each agent (longer with many
    agents): the agent heartbeats at that one, not at its own setting."""
    async def go():
        fake = ShorterIntervalController()
        server, port = await serve_controller(fake)
        agent = Agent(AgentSettings(controllers=(f"127.0.0.1:{port}",), interval_s=INTERVAL_S), [],
                      SecuritySettings())
        loop = asyncio.create_task(agent._heartbeat_loop())
        try:
            await asyncio.sleep(1.6)
        finally:
            await stop(loop, agent, server)
        assert agent.interval_s == 0.3
        assert len(fake.times) >= 4, fake.times  # every 0.3 s, not every 2 s

    asyncio.run(go())


def test_an_exit_is_timed_until_an_accepted_heartbeat_carried_it():
    """``/metrics``' exit report time: from the agent seeing an exit (once per exit,
    however often processes change after it) to the Controller accepting a heartbeat
    built after it; an exit seen while a heartbeat is in flight waits for the next."""
    from types import SimpleNamespace

    async def go():
        fake = SlowController(0.3)
        server, port = await serve_controller(fake)
        agent = Agent(AgentSettings(controllers=(f"127.0.0.1:{port}",)), [], SecuritySettings())
        dead = SimpleNamespace(instance_id="e0..e3", state="exited", num_restarts=0)
        agent.processes.append(dead)
        try:
            agent._on_process_change()
            agent._on_process_change()  # another process's change: the same exit
            await agent.heartbeat_once()
            assert agent.stats.num_exit_reports == 1 and agent.stats.num_ok == 1
            assert 0.3 <= agent.stats.exit_report_seconds_max < 1.5
            first = asyncio.create_task(agent.heartbeat_once())
            await asyncio.sleep(0.1)  # in flight: built before the next exit
            dead.num_restarts = 1  # it restarted and died again
            agent._on_process_change()
            await first
            assert agent.stats.num_exit_reports == 1
            await agent.heartbeat_once()
            assert agent.stats.num_exit_reports == 2 and agent.stats.num_ok == 3
            assert agent.stats.exit_report_seconds_total >= 0.3 + 0.3  # the second: a whole round trip more
        finally:
            agent.processes.clear()
            await agent.stop()
            await server.stop(grace=None)

    asyncio.run(go())

