"""The NodeAgents of a ``pdserve up`` run, and how the run follows the SLO planner.

Without the planner one NodeAgent supervises every engine. With ``spec.planner.enabled``
each engine gets a NodeAgent of its own, as each gets a Pod on Kubernetes, so the run
can add and remove engines one at a time: when the Controller's view asks for other
pool sizes (``PlannerView.replicas_prefill`` / ``replicas_decode``), ``follow`` starts
the next ordinal of a pool that is short, or drains the highest ordinal of a pool that
is too large through the Controller (its Drain call: no new requests, the running ones
finish) and then stops its NodeAgent, which stops its engine.

Invariants: ``sizes`` is what runs (or starts) per pool, so a planner's ask is acted on
once; a pool is never taken below one engine by the run itself (the planner's own
minimums are at least one); an advisory planner's asks are never followed; a drain
that does not finish within ``DRAIN_DEADLINE_S`` stops the engine anyway (its requests
then fail over, as on a Pod deletion).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc

from pdserve.api.instance import instance_name
from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.runtime.security import SecuritySettings, create_channel

POOLS = ("prefill", "decode", "hybrid")
PLANNED_POOLS = ("prefill", "decode")
DRAIN_DEADLINE_S = 30.0
STATUS_TIMEOUT_S = 1.0


class LocalAgents:
    """Called from ``pdserve up``'s main thread only. ``spawn(name, argv)`` starts a
    process of the run; ``wait_ready(name)`` returns its "supervising" line (None when
    the run is stopping); ``stop(name)`` stops one and forgets it."""

    def __init__(self, cluster_name: str, spec_file: Path, controller: str, security: SecuritySettings,
                 sizes: dict[str, int], engine_args: list[str], one_per_engine: bool,
                 spawn: Callable, wait_ready: Callable, stop: Callable, say: Callable[[str], None]) -> None:
        self.cluster_name, self.spec_file, self.controller = cluster_name, spec_file, controller
        self.security, self.engine_args, self.one_per_engine = security, engine_args, one_per_engine
        self.sizes = dict(sizes)
        self._spawn, self._wait_ready, self._stop, self._say = spawn, wait_ready, stop, say
        self.http_ports: dict[str, int] = {}           # agent name -> its /status port
        self._draining: dict[str, float] = {}          # instance id -> drain deadline (monotonic)
        self._num_actions_said = 0

    def instances(self) -> list[tuple[str, str]]:
        """(instance id, pool) of every engine the run has now."""
        return [(instance_name(self.cluster_name, pool, i), pool)
                for pool, num in self.sizes.items() for i in range(num)]

    def start_all(self) -> bool:
        """Start the agents of the spec's engines; False when the run stopped meanwhile."""
        if not self.one_per_engine:
            return self._start_agent("nodeagent", f"{self.cluster_name}-local", self.instances())
        return all(self._start_agent(_agent_name(iid), f"{self.cluster_name}-{iid}", [(iid, pool)])
                   for iid, pool in self.instances())

    def _start_agent(self, name: str, agent_id: str, instances: list[tuple[str, str]]) -> bool:
        self._spawn(name, ["nodeagent", "-f", str(self.spec_file), "--controller", self.controller,
                           "--host", "127.0.0.1", "--agent-id", agent_id, "--pin-cpus",
                           *(f"--instance={iid}={pool}" for iid, pool in instances), *self.engine_args])
        if (line := self._wait_ready(name)) is None:
            return False
        self.http_ports[name] = int(re.search(r"http port (\d+)", line).group(1))
        return True

    def engine_status(self) -> list[dict]:
        """Every agent's ``/status`` engines (none for one that does not answer), each
        with the name of its ``agent`` (its log's)."""
        return [{**e, "agent": name} for name, port in self.http_ports.items() for e in get_engine_status(port)]

    # --- following the planner ---------------------------------------------------
    def follow(self, planner: pb.PlannerView) -> None:
        """Called on every view: says each new planner action, then takes one step
        towards the pool sizes the planner asks for."""
        if planner.num_actions > self._num_actions_said:
            self._num_actions_said = planner.num_actions
            self._say(f"planner: {planner.last_action} ({planner.reason})")
        if not self.one_per_engine or planner.advisory:
            return
        for pool in PLANNED_POOLS:
            asked = getattr(planner, f"replicas_{pool}")
            if asked > self.sizes[pool]:
                iid = instance_name(self.cluster_name, pool, self.sizes[pool])
                self._say(f"planner: starting {iid} ({planner.last_action})")
                self.sizes[pool] += 1
                self._start_agent(_agent_name(iid), f"{self.cluster_name}-{iid}", [(iid, pool)])
            elif 0 < asked < self.sizes[pool] and self.sizes[pool] > 1:
                self._shrink(pool)

    def _shrink(self, pool: str) -> None:
        """Drain the pool's highest ordinal, then stop it (one call per view: no wait here)."""
        iid = instance_name(self.cluster_name, pool, self.sizes[pool] - 1)
        if iid not in self._draining:
            self._say(f"planner: draining {iid} to stop it")
            self._draining[iid] = time.monotonic() + DRAIN_DEADLINE_S
        drained = drain(self.controller, self.security, iid, DRAIN_DEADLINE_S)
        if drained is None or not (drained.is_drained or time.monotonic() > self._draining[iid]):
            return
        del self._draining[iid]
        self._stop(_agent_name(iid))
        self.http_ports.pop(_agent_name(iid), None)
        self.sizes[pool] -= 1
        self._say(f"planner: stopped {iid}" + ("" if drained.is_drained else " (drain deadline passed)"))


def _agent_name(instance_id: str) -> str:
    return f"nodeagent-{instance_id}"


def get_engine_status(http_port: int) -> list[dict]:
    """A NodeAgent's ``/status`` engines; [] while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status",
                                    timeout=STATUS_TIMEOUT_S) as reply:
            return json.load(reply)["engines"]
    except (OSError, urllib.error.URLError, ValueError, KeyError):
        return []


def _call(address: str, security: SecuritySettings, method: str, request):
    async def go():
        async with create_channel(address, security) as channel:
            return await getattr(pb_grpc.ControllerStub(channel), method)(
                request, timeout=2, metadata=security.metadata())

    try:
        return asyncio.run(go())
    except grpc.RpcError:
        return None


def get_view(address: str, security: SecuritySettings) -> pb.ClusterView | None:
    """The Controller's view; None while it does not answer."""
    return _call(address, security, "GetView", pb.WatchViewRequest(coordinator_id="pdserve-up"))


def drain(address: str, security: SecuritySettings, instance_id: str, deadline_s: float) -> pb.DrainResponse | None:
    """Ask the Controller to drain an instance (once; later calls report progress)."""
    return _call(address, security, "Drain", pb.DrainRequest(instance_id=instance_id, deadline_s=deadline_s))
