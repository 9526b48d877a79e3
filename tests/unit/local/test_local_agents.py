"""``pdserve up`` following the planner: one NodeAgent per engine, the next ordinal
started when a pool is short, the highest drained then stopped when it is too large
(processes and the Controller faked; the integration test runs them for real)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.api.proto import controller_pb2 as pb
from pdserve.local import agents as agents_module
from pdserve.local.agents import LocalAgents
from pdserve.runtime.security import SecuritySettings


class Fake:
    def __init__(self) -> None:
        self.spawned: list[tuple[str, list[str]]] = []
        self.stopped: list[str] = []
        self.said: list[str] = []
        self.drained: list[str] = []
        self.idle = False

    def spawn(self, name, argv):
        self.spawned.append((name, argv))

    def drain(self, address, security, instance_id, deadline_s):
        self.drained.append(instance_id)
        return pb.DrainResponse(is_known=True, is_drained=self.idle)


@pytest.fixture
def fake(monkeypatch):
    f = Fake()
    monkeypatch.setattr(agents_module, "drain", f.drain)
    return f


def make(fake: Fake, one_per_engine=True, sizes=None) -> LocalAgents:
    return LocalAgents("c", Path("spec.yaml"), "127.0.0.1:1", SecuritySettings(),
                       sizes or {"prefill": 1, "decode": 2, "hybrid": 0}, ["--engine-arg=--x"],
                       one_per_engine, spawn=fake.spawn, wait_ready=lambda name: "... (http port 4242, ...)",
                       stop=fake.stopped.append, say=fake.said.append)


def planner(p: int, d: int, advisory=False) -> pb.PlannerView:
    return pb.PlannerView(replicas_prefill=p, replicas_decode=d, advisory=advisory, last_action="x")


def test_without_the_planner_one_agent_runs_every_engine_and_asks_are_ignored(fake):
    a = make(fake, one_per_engine=False)
    assert a.start_all()
    [(name, argv)] = fake.spawned
    assert name == "nodeagent" and [x for x in argv if x.startswith("--instance")] == [
        "--instance=c-prefill-0=prefill", "--instance=c-decode-0=decode", "--instance=c-decode-1=decode"]
    a.follow(planner(3, 2))
    assert len(fake.spawned) == 1


def test_with_the_planner_each_engine_has_its_agent_and_a_short_pool_gets_the_next_ordinal(fake):
    a = make(fake)
    assert a.start_all()
    assert [n for n, _ in fake.spawned] == ["nodeagent-c-prefill-0", "nodeagent-c-decode-0", "nodeagent-c-decode-1"]
    assert a.http_ports["nodeagent-c-decode-1"] == 4242
    a.follow(planner(2, 2))
    name, argv = fake.spawned[-1]
    assert name == "nodeagent-c-prefill-1" and "--instance=c-prefill-1=prefill" in argv and "--engine-arg=--x" in argv
    assert a.sizes["prefill"] == 2
    a.follow(planner(2, 2))  # acted on once
    assert len(fake.spawned) == 4


def test_a_pool_too_large_drains_its_highest_ordinal_then_stops_it(fake):
    a = make(fake)
    a.start_all()
    a.follow(planner(1, 1))
    assert fake.drained == ["c-decode-1"] and fake.stopped == [] and a.sizes["decode"] == 2
    fake.idle = True
    a.follow(planner(1, 1))
    assert fake.stopped == ["nodeagent-c-decode-1"] and a.sizes["decode"] == 1
    assert "nodeagent-c-decode-1" not in a.http_ports
    a.follow(planner(1, 0))  # never below one engine, whatever is asked
    assert fake.stopped == ["nodeagent-c-decode-1"]


def test_an_advisory_planner_is_never_followed(fake):
    a = make(fake)
    a.start_all()
    a.follow(planner(3, 1, advisory=True))
    assert len(fake.spawned) == 3 and fake.drained == []


def test_a_drain_past_its_deadline_stops_the_engine_anyway(fake, monkeypatch):
    monkeypatch.setattr(agents_module, "DRAIN_DEADLINE_S", 0.0)
    a = make(fake)
    a.start_all()
    a.follow(planner(1, 1))
    assert fake.stopped == ["nodeagent-c-decode-1"] and "drain deadline passed" in fake.said[-1]
