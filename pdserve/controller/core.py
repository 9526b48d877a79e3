"""The Controller process's brain: election, the leader's cluster state, the view.

Owns the ``Cluster`` (only while leading), the ``Election`` and the
``StatePersister``. Called by the gRPC service (heartbeats, view watchers) and
runs two loops: the election, and the leader's tick (health timeouts, mode,
role switches, persistence, view publication) every half heartbeat interval.

Invariants: a standby never answers heartbeats (``NotLeader``) and never writes
state; a new leader loads the last leader's state before it answers anything;
every view change wakes every watcher (one ``asyncio.Condition``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from pdserve.api.proto import controller_pb2 as pb
from pdserve.controller.cluster import Cluster, ClusterSettings
from pdserve.controller.election import Election
from pdserve.controller.persist import StatePersister
from pdserve.controller.store import Store

log = logging.getLogger(__name__)


class NotLeader(Exception):
    """Raised to callers while this replica is a standby; the message names the leader."""


@dataclass(frozen=True)
class ControllerSettings:
    cluster_name: str = "local"
    identity: str = "controller-0"      # also the address agents can use (host:port)
    cluster: ClusterSettings = ClusterSettings()
    leader_ttl_s: int = 5
    lease_ttl_s: int = 30
    view_refresh_s: float = 1.0         # watchers get fresh load at least this often


class Controller:
    def __init__(self, settings: ControllerSettings, store: Store, clock=time.monotonic) -> None:
        self.settings, self.store, self.clock = settings, store, clock
        prefix = f"/pdserve/{settings.cluster_name}"
        self.persister = StatePersister(store, prefix, settings.lease_ttl_s)
        self.election = Election(store, f"{prefix}/leader", settings.identity,
                                 settings.leader_ttl_s, self._on_leadership)
        self.cluster: Cluster | None = None
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self.num_leader_changes = 0
        self.num_failovers = 0          # counted by earlier terms of this replica
        self.num_role_switches = 0

    @property
    def is_leader(self) -> bool:
        return self.election.is_leader and self.cluster is not None

    async def start(self) -> None:
        """Called once by the server factory: first election attempt, then the loops."""
        with contextlib.suppress(Exception):
            await self.election.step()
        self._tasks = [asyncio.create_task(self.election.run()), asyncio.create_task(self._tick_loop())]

    async def stop(self) -> None:
        """Called on shutdown: stop the loops, write what is dirty, hand leadership over."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.cluster is not None:
            await self.persister.flush(self.cluster, self.clock())
        await self.election.resign()
        await self.store.close()

    async def _on_leadership(self, is_leader: bool) -> None:
        self.num_leader_changes += 1
        if is_leader:
            self.cluster = await self.persister.load(self.settings.cluster, self.clock())
            self.cluster._event(f"{self.settings.identity} leads "
                                f"({len(self.cluster.records)} instances loaded)")
        else:
            if self.cluster is not None:
                self.num_failovers += self.cluster.num_failovers
                self.num_role_switches += self.cluster.num_role_switches
            self.cluster = None
        await self._notify()

    async def _tick_loop(self) -> None:
        period = self.settings.cluster.thresholds.interval_s / 2
        while True:
            cluster = self.cluster
            if cluster is not None and self.election.is_leader:
                now = self.clock()
                cluster.tick(now)
                await self.persister.flush(cluster, now)
                cluster.view(self.election.leader)  # bumps the version if the view changed
                await self._notify()
            await asyncio.sleep(period)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _require_leader(self) -> Cluster:
        cluster = self.cluster
        if cluster is None or not self.election.is_leader:
            raise NotLeader(f"standby; leader is {self.election.leader or 'unknown'}")
        return cluster

    async def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        """Called by the gRPC Heartbeat handler."""
        cluster = self._require_leader()
        before = cluster.view_version
        commands = cluster.apply_heartbeat(request.agent_id, request.instances, self.clock())
        if cluster.view(self.election.leader).version != before:
            await self._notify()
        return pb.HeartbeatResponse(
            commands=commands, heartbeat_interval_s=self.settings.cluster.thresholds.interval_s)

    def view(self) -> pb.ClusterView:
        """Called by GetView and WatchView; raises ``NotLeader`` on a standby."""
        return self._require_leader().view(self.election.leader)

    async def watch(self):
        """Yields the view now, on every change, and every ``view_refresh_s``."""
        while True:
            view = self.view()
            yield view
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wait_version(view.version), self.settings.view_refresh_s)

    async def _wait_version(self, version: int) -> None:
        while self.cluster is not None and self.cluster.view_version == version:
            await self._changed.wait()
