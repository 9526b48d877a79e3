"""Mirror of the leader's state in the store, and its load by a new leader.

Keys under ``/pdserve/<cluster>/``:

- ``instances/<id>``: an ``InstanceRecord`` (JSON), each under its own lease of
  ``lease_ttl_s``, kept alive while the instance's agent heartbeats. An agent that
  goes silent lets its entries expire; so does a Controller that dies with no
  standby to take over.
- ``meta``: the mode (PD/FALLBACK/COLOCATED), missing pools, whether the cluster was
  complete once, the pool sizes the planner asks for, and the peer list's version
  (never handed out before it is written: a new leader goes on counting from it). No lease: it is the
  cluster's, not a process's.
- ``replace/<id>``: a replacement request for the operator (``load_replacements``;
  ``delete_replacement`` once it has acted). No lease.
- ``leader``: the elected Controller (see ``election.py``).

Every put and delete carries the leader's fence (``fence()``, the election's
``write_fence``): a replica that no longer leads cannot write, and its flush raises
``FencedError`` (the Controller then steps down) instead of counting an outage.

Invariants: a write that fails leaves its key dirty for the next flush, and a
change made while its key is being written is written by the next flush; after the
store comes back from an outage every record and the meta are written again
(etcd restarted from an older snapshot, or lost its data, converges); once the
operator had the cluster forgotten (``ForgottenPersister``) nothing is written again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.controller.cluster import Cluster, ClusterSettings
from pdserve.controller.fallback import ModeState
from pdserve.controller.health import InstanceRecord
from pdserve.controller.store import Fence, FencedError, Store, StoreError
from pdserve.runtime.aio import gather_limited

log = logging.getLogger(__name__)

LEASE_CONCURRENCY = 32  # lease keepalives in flight at once (``keep_leases``)


@dataclass(frozen=True)
class ReplacementRequest:
    """One ``replace/<id>`` key: the Controller wants the instance's Pod recreated."""

    instance_id: str
    reason: str
    requested_unix_s: float


class StatePersister:
    def __init__(self, store: Store, prefix: str, lease_ttl_s: int,
                 fence: Callable[[], Fence] | None = None) -> None:
        """``fence()`` gives the fence of each write (raising ``FencedError`` when there is
        none); without it writes are not fenced (tests, tools)."""
        self.store, self.prefix, self.lease_ttl_s = store, prefix.rstrip("/"), lease_ttl_s
        self._fence = fence
        self.is_store_ok = True
        self.num_writes = 0  # puts and deletes the store took (``pdserve_controller_store_writes``)

    async def _put(self, key: str, value: str, lease: int | None = None) -> None:
        await self.store.put(key, value, lease, fence=self._fence() if self._fence else None)
        self.num_writes += 1

    async def _delete(self, key: str) -> None:
        await self.store.delete(key, fence=self._fence() if self._fence else None)
        self.num_writes += 1

    def key(self, *parts: str) -> str:
        return "/".join([self.prefix, *parts])

    async def load(self, settings: ClusterSettings, now_s: float) -> Cluster:
        """Called by the Controller when it becomes leader: the last leader's state."""
        cluster = Cluster(settings, now_s)
        for key, text in (await self.store.get_prefix(self.key("instances", ""))).items():
            try:
                rec = InstanceRecord.from_json(text, now_s)
            except (ValueError, TypeError) as exc:
                log.warning("skipping unreadable record %s: %s", key, exc)
                continue
            cluster.records[rec.instance_id] = rec
        meta = await self.store.get(self.key("meta"))
        if meta:
            data = json.loads(meta)
            cluster.replicas.update(data.pop("planner_replicas", {}))
            cluster.peers_version = data.pop("peers_version", 0)
            cluster.mode = ModeState(**data)
            cluster.mode.complete_since_s = None
        # a record written before the meta of its list version: count on from past both
        cluster.peers_version = max([cluster.peers_version,
                                     *(r.peers_listed_version for r in cluster.records.values())])
        return cluster

    async def load_replacements(self) -> list[ReplacementRequest]:
        """Every outstanding replacement request. Called for the operator's ListReplacements."""
        out = []
        for key, text in (await self.store.get_prefix(self.key("replace", ""))).items():
            data = json.loads(text)
            out.append(ReplacementRequest(data.get("instance", key.rsplit("/", 1)[-1]),
                                          data.get("reason", ""), data.get("requested_unix_s", 0.0)))
        return out

    async def delete_replacement(self, instance_id: str) -> None:
        """Called for the operator's AckReplacement: it has acted on the request."""
        await self._delete(self.key("replace", instance_id))

    async def delete_all(self) -> int:
        """Delete every key of the cluster but the leader key; returns how many."""
        leader_key = self.key("leader")
        keys = [k for k in await self.store.get_prefix(self.prefix + "/") if k != leader_key]
        for key in keys:
            await self._delete(key)
        return len(keys)

    def forgotten(self) -> ForgottenPersister:
        """The persister to install once the operator deleted the cluster."""
        forgotten = ForgottenPersister(self.store, self.prefix, self.lease_ttl_s, self._fence)
        forgotten.num_writes = self.num_writes  # a counter goes on
        return forgotten

    async def flush(self, cluster: Cluster, now_s: float) -> None:
        """Called by the leader's tick loop: write what changed (``keep_leases`` keeps the
        leases alive, after the view is out).
        Raises ``FencedError`` when this replica no longer leads (nothing more is written)."""
        try:
            if not self.is_store_ok:  # back from an outage: write everything again
                cluster.dirty.update(cluster.records)
                cluster.meta_dirty = True
            await self._flush(cluster, now_s)
            if not self.is_store_ok:
                log.info("store reachable again; state rewritten")
            self.is_store_ok = True
        except FencedError:
            raise
        except StoreError as exc:
            if self.is_store_ok:
                log.warning("store unreachable, state kept in memory: %s", exc)
            self.is_store_ok = False

    async def keep_leases(self, cluster: Cluster, now_s: float) -> None:
        """Called by the leader after each commit's view is out: keep alive the lease of
        every instance still heard, each a third of its TTL after the last, at most
        ``LEASE_CONCURRENCY`` at once. A lease that expired meanwhile makes its record
        dirty (the next flush writes it under a new one). Not in the flush, one by one, as
        before: a thousand instances registered together come due together, and their
        keepalives held the view back (an engine that exited left the Coordinators' views
        5.8 s later at 1,000 agents, 0.08 s at 300). A store outage is noted as a flush's is."""
        interval = cluster.settings.thresholds.interval_s
        due = [rec for rec in cluster.records.values()
               if rec.lease_id and now_s - rec.last_heartbeat_s < 2 * max(interval, rec.interval_s)
               and now_s - rec.lease_refreshed_s >= self.lease_ttl_s / 3]
        if not due:
            return

        async def refresh(rec: InstanceRecord) -> None:
            lease_id = rec.lease_id
            is_alive = await self.store.refresh_lease(lease_id)
            if not is_alive and rec.lease_id == lease_id:
                rec.lease_id = 0
                cluster.dirty.add(rec.instance_id)
            rec.lease_refreshed_s = now_s

        results = await gather_limited(due, refresh, LEASE_CONCURRENCY)
        if errors := [r for r in results if isinstance(r, BaseException)]:
            if not isinstance(errors[0], StoreError):
                raise errors[0]
            if self.is_store_ok:
                log.warning("store unreachable, state kept in memory: %s", errors[0])
            self.is_store_ok = False

    async def _flush(self, cluster: Cluster, now_s: float) -> None:
        while cluster.dirty:
            # taken off before the write: a heartbeat that changes the record while the
            # write is in flight marks it dirty again, so its change is written next
            rec = cluster.records.get(instance_id := cluster.dirty.pop())
            if rec is None:
                continue
            try:
                if not rec.lease_id:
                    rec.lease_id = await self.store.grant_lease(self.lease_ttl_s)
                    rec.lease_refreshed_s = now_s
                await self._put(self.key("instances", instance_id), rec.to_json(), rec.lease_id)
            except BaseException:
                cluster.dirty.add(instance_id)
                raise
        for instance_id in list(cluster.removed):
            await self._delete(self.key("instances", instance_id))
            cluster.removed.discard(instance_id)
        while cluster.replacements:
            instance_id, reason = cluster.replacements[0]
            await self._put(self.key("replace", instance_id), json.dumps(
                {"instance": instance_id, "reason": reason, "requested_unix_s": time.time()}))
            cluster.replacements.pop(0)
        if cluster.meta_dirty:
            m, cluster.meta_dirty = cluster.mode, False
            try:
                await self._put(self.key("meta"), json.dumps({
                    "mode": m.mode, "reason": m.reason, "missing_roles": m.missing_roles,
                    "has_been_complete": m.has_been_complete, "peers_version": cluster.peers_version,
                    **({"planner_replicas": cluster.replicas} if cluster.planner else {})}))
            except BaseException:
                cluster.meta_dirty = True
                raise


class ForgottenPersister(StatePersister):
    """Installed by ``Controller.forget_cluster``: the deleted cluster's state is never
    written again (a flush does nothing; loads and deletes still work)."""

    async def flush(self, cluster: Cluster, now_s: float) -> None:
        return None
