"""The agent probes at most ``probe_concurrency`` engines at once: an agent of a
thousand engines had a thousand probes in flight on a busy host, each turn of its event
loop ran them all, and its heartbeats waited behind them (three missed intervals: every
instance SUSPECT together). Every engine is still probed, in turn. And at most
``probe_max_rate`` probes a second: each engine's interval stretches with their number
(a thousand simulated engines answering a probe each a second took most of two cores)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.api.proto import engine_pb2
from pdserve.nodeagent.agent import Agent, AgentSettings, SupervisedEngine
from pdserve.runtime.security import SecuritySettings


class SlowProber:
    """Answers health and stats after ``delay_s``; counts the probes in flight."""

    in_flight = most = answered = 0

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def _answer(self, response):
        cls = SlowProber
        cls.in_flight += 1
        cls.most = max(cls.most, cls.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            cls.in_flight -= 1
        return response

    async def health(self, timeout_s: float):
        return await self._answer(engine_pb2.HealthResponse(role="decode", kv_endpoint="e:1", kv_transport="tcp"))

    async def stats(self, timeout_s: float):
        SlowProber.answered += 1
        return await self._answer(engine_pb2.StatsResponse())

    async def close(self) -> None:
        pass


def agent_of(num: int, delay_s: float, **settings) -> tuple[Agent, list[SupervisedEngine]]:
    SlowProber.in_flight = SlowProber.most = SlowProber.answered = 0
    launch = SimpleNamespace(prober=lambda address, security: SlowProber(delay_s), serving_address=None,
                             command=lambda role: ([], {}))
    engines = [SupervisedEngine(f"d{i}", "decode", "decode", [], launch=launch) for i in range(num)]
    agent = Agent(AgentSettings(**settings), engines, SecuritySettings())
    for i, inst in enumerate(engines):
        inst.process, inst.index = SimpleNamespace(state="running", addresses=[f"127.0.0.1:{i + 1}"]), 0
    return agent, engines


async def run_probes(agent: Agent, engines: list[SupervisedEngine], seconds: float) -> None:
    loops = [asyncio.create_task(agent._probe_loop(inst)) for inst in engines]
    await asyncio.sleep(seconds)
    for loop in loops:
        loop.cancel()
    await asyncio.gather(*loops, return_exceptions=True)


def test_probes_in_flight_stay_within_the_limit_and_every_engine_is_probed():
    async def go():
        agent, engines = agent_of(60, 0.05, interval_s=0.1, probe_concurrency=8, probe_max_rate=1000.0)
        await run_probes(agent, engines, 2.0)
        assert SlowProber.most == 8, SlowProber.most  # 60 engines due at once, 8 probed at a time
        assert all(inst.probe_ok for inst in engines)  # each in turn, none timed out in the queue

    asyncio.run(go())


@pytest.mark.parametrize("num,interval_s", [(60, 0.6), (20, 0.25)])
def test_many_engines_stretch_the_probe_interval_to_the_rate(num, interval_s):
    async def go():
        agent, engines = agent_of(num, 0.001, interval_s=0.25, probe_max_rate=100.0)
        assert agent.probe_interval_s == pytest.approx(interval_s)
        await run_probes(agent, engines, 2.0)
        assert all(inst.probe_ok for inst in engines)  # each probed within its first interval
        # at most the rate, plus the first round spread over an interval
        assert num <= SlowProber.answered <= num + 2.0 * min(100.0, num / interval_s) + 1, SlowProber.answered

    asyncio.run(go())

