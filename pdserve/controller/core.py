"""The Controller process's brain: election, the leader's cluster state, the view.

Owns the ``Cluster`` (only while leading), the ``Election`` and the
``StatePersister``. Called by the gRPC service: agents' heartbeats, view
watchers, and the operator's requests (``drain``, ``list_replacements``,
``acknowledge_replacement``, ``forget_cluster``), each of which raises
``NotLeader`` on a standby. Runs two loops: the election, and the leader's
commit loop: every half heartbeat interval a tick (health timeouts, mode, role
switches), and after every tick or heartbeat that changed a record, a write to
the store then the view's publication.

Leadership is the election's (``election.py``): a leader cut off from the store
stops acting before its lease can expire, and every write carries the term's
fence; a write the store refuses (``FencedError``) makes this replica step down at
once. Stepping down drops the cluster state; taking over loads it again.

Invariants: a standby never answers heartbeats (``NotLeader``) and never writes
state; a new leader loads the last leader's state before it answers anything;
what the view shows was written to the store first (write, then publish), so a
leader killed at any moment hands over exactly the view its clients last saw;
every view change wakes every watcher (one ``asyncio.Condition``); ``stop`` ends
every watch stream first, so the gRPC server never has a stream to cancel.

Pair checks: a heartbeat's reply carries the peer list (the decode engines the
prefill engines' agents probe, ``Cluster.peer_list``) when the agent holds another
version, and only a version already written to the store; each agent reports the
version it has probed and the peers it cannot reach, and the view publishes them
(``Cluster.view``), so Coordinators route on one probe per pair for the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from pdserve.api.proto import controller_pb2 as pb
from pdserve.controller.cluster import Cluster, ClusterSettings, DrainProgress
from pdserve.controller.election import Election
from pdserve.controller.persist import ReplacementRequest, StatePersister
from pdserve.controller.store import FencedError, Store
from pdserve.runtime.aio import wait_event

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
        self.election = Election(store, f"{prefix}/leader", settings.identity,
                                 settings.leader_ttl_s, self._on_leadership, clock)
        self.persister = StatePersister(store, prefix, settings.lease_ttl_s, self.election.write_fence)
        self.cluster: Cluster | None = None
        self._view: pb.ClusterView | None = None  # the published view: written to the store first
        self._peers: pb.PeerList | None = None  # the peer list agents are sent: written first too
        self._commit_soon = asyncio.Event()       # set by a heartbeat that changed a record
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self._is_stopping = False
        self.num_leader_changes = 0
        self.num_failovers = 0          # counted by earlier terms of this replica
        # heartbeats handled as leader, the instance reports in them, and the CPU seconds
        # of their handling (apply and reply; ``pdserve_controller_heartbeat*``)
        self.num_heartbeats, self.num_instance_reports, self.heartbeat_cpu_s = 0, 0, 0.0
        self.num_role_switches = 0
        self.stalled_s = 0.0  # seconds the commit loop woke late (``pdserve_controller_stalled_seconds``)

    @property
    def is_leader(self) -> bool:
        return self.election.is_leader and self.cluster is not None

    async def start(self) -> None:
        """Called once by the server factory: first election attempt, then the loops."""
        with contextlib.suppress(Exception):
            await self.election.step()
        self._tasks = [asyncio.create_task(self.election.run()), asyncio.create_task(self._commit_loop())]

    async def stop(self) -> None:
        """Called on shutdown, before the gRPC server stops: end the watch streams (each
        client sees the stream end and tries the next replica), stop the loops, write
        what is dirty, hand leadership over."""
        self._is_stopping = True
        await self._notify()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.cluster is not None:
            with contextlib.suppress(FencedError):  # no longer leads: nothing to write
                await self.persister.flush(self.cluster, self.clock())
        await self.election.resign()
        await self.store.close()

    async def _on_leadership(self, is_leader: bool) -> None:
        """Called by the election on every change (serialized): load on taking over
        (a load that fails leaves this replica a standby), drop the state on stepping down."""
        if is_leader:
            cluster = await self.persister.load(self.settings.cluster, self.clock())
            cluster.record_event(f"{self.settings.identity} leads ({len(cluster.records)} instances loaded)")
            self._view = cluster.view(self.election.leader)  # loaded from the store: already written
            self.cluster = cluster
        else:
            if self.cluster is not None:
                self.num_failovers += self.cluster.num_failovers
                self.num_role_switches += self.cluster.num_role_switches
            self.cluster, self._view = None, None
        self._peers = None  # a new term's first commit writes, then hands out, its list
        self.num_leader_changes += 1
        await self._notify()

    async def _commit_loop(self) -> None:
        """A tick every half interval, a commit after it and on every wake-up. How late
        the wait ends is the event loop's own stall (a timer is all it waits on): ticks
        judge silence net of it (``Cluster.tick``), counted in ``stalled_s``."""
        period = self.settings.cluster.thresholds.interval_s / 2
        last_tick_s, stalled_s = float("-inf"), 0.0
        while True:
            self._commit_soon.clear()
            cluster = self.cluster
            if cluster is not None and self.election.is_leader:
                now = self.clock()
                if now - last_tick_s >= period:
                    cluster.tick(now, stalled_s)
                    last_tick_s, stalled_s = now, 0.0
                await self._commit(cluster, now)
            wait_s = max(0.0, period - (self.clock() - last_tick_s)) if self.cluster else period
            wake_s = self.clock() + wait_s
            await wait_event(self._commit_soon, wait_s)
            if (late_s := self.clock() - wake_s) > period / 5:
                stalled_s += late_s
                self.stalled_s += late_s

    async def _commit(self, cluster: Cluster, now_s: float) -> None:
        """Take the view, write what changed, publish that view, then keep the leases alive.

        The view is taken before the write: a heartbeat applied while the write is in
        flight changes memory, not the published view, and is written (then shown)
        by the next commit. While the store is unreachable the view is published
        before the write is tried: no successor can load state without the store
        either, and the Coordinators must not wait out the store's timeout.
        """
        view = cluster.view(self.election.leader)
        peers = cluster.peer_list()
        if not self.persister.is_store_ok:
            await self._publish(cluster, view)
        try:
            await self._fenced(self.persister.flush(cluster, now_s))
        except NotLeader:
            return
        if self.persister.is_store_ok and cluster is self.cluster:
            # only a written list version goes out: a new leader counts on past it, so a
            # version an agent reports as checked names one list in every term
            self._peers = peers
        await self._publish(cluster, view)
        if self.persister.is_store_ok and cluster is self.cluster:
            await self.persister.keep_leases(cluster, now_s)  # after the view: it waits for none

    async def _fenced(self, write):
        """Await a write of this term; a write the store refused (another replica leads,
        or this one's deadline passed) steps this replica down and raises ``NotLeader``."""
        try:
            return await write
        except FencedError as exc:
            await self.election.step_down(f"a write was refused: {exc}")
            raise NotLeader(f"no longer the leader; leader is {self.election.leader or 'unknown'}") from exc

    async def _publish(self, cluster: Cluster, view: pb.ClusterView) -> None:
        if cluster is not self.cluster or not self.election.is_leader:  # leadership changed while writing
            return
        before = self._view.version if self._view is not None else None
        self._view = view
        if view.version != before:
            await self._notify()

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
        started_s = time.thread_time()
        commands = cluster.apply_heartbeat(request.agent_id, request.instances, self.clock())
        if cluster.dirty:
            self._commit_soon.set()  # the commit loop writes the change, then publishes it
        peers = self._peers if self._peers is not None and self._peers.version != request.peers_version else None
        reply = pb.HeartbeatResponse(
            commands=commands, heartbeat_interval_s=cluster.heartbeat_interval_s,
            peers=peers)
        self.num_heartbeats += 1
        self.num_instance_reports += len(request.instances)
        self.heartbeat_cpu_s += time.thread_time() - started_s
        return reply

    def view(self) -> pb.ClusterView:
        """Called by GetView and WatchView: the published view; raises ``NotLeader`` on a standby."""
        self._require_leader()
        assert self._view is not None  # published when leadership was taken
        return self._view

    async def watch(self):
        """Yields the view now, on every change, and every ``view_refresh_s``; returns
        when the Controller stops."""
        while not self._is_stopping:
            view = self.view()
            yield view
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wait_version(view.version), self.settings.view_refresh_s)

    async def _wait_version(self, version: int) -> None:
        while not self._is_stopping and self._view is not None and self._view.version == version:
            await self._changed.wait()

    # --- the operator's requests ------------------------------------------------
    def drain(self, instance_id: str, deadline_s: float) -> DrainProgress:
        """Called by the Drain RPC: the operator drains an instance before deleting it."""
        return self._require_leader().request_drain(instance_id, deadline_s)

    async def list_replacements(self) -> list[ReplacementRequest]:
        """Called by the ListReplacements RPC on every reconcile pass."""
        self._require_leader()
        return await self.persister.load_replacements()

    async def acknowledge_replacement(self, instance_id: str) -> None:
        """Called by the AckReplacement RPC once the operator deleted the instance's Pod
        for recreation: the request is deleted and the failure history cleared."""
        cluster = self._require_leader()
        await self._fenced(self.persister.delete_replacement(instance_id))
        cluster.clear_replacement(instance_id)

    async def forget_cluster(self) -> int:
        """Called by the ForgetCluster RPC (the operator's delete handler, after every
        engine Pod is gone): from now on nothing is written, and every key of the
        cluster but the leader key is deleted. Returns the number of keys deleted."""
        cluster = self._require_leader()
        self.persister = self.persister.forgotten()
        cluster.forget_all()
        return await self._fenced(self.persister.delete_all())
