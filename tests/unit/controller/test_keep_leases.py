"""Lease keepalives: after the view is out, many at once. A thousand instances
registered together come due together; kept alive one by one inside the flush, before
the view was published, they held a failed engine's removal from the Coordinators'
views back 5.8 s at 1,000 agents (``benchmarks/controller_fanin.py``)."""

from __future__ import annotations

import asyncio

from pdserve.api.proto import controller_pb2 as pb
from pdserve.controller import persist
from pdserve.controller.cluster import Cluster, ClusterSettings
from pdserve.controller.core import Controller, ControllerSettings
from pdserve.controller.persist import StatePersister
from pdserve.controller.store import MemoryStore, StoreError


class SlowLeases(MemoryStore):
    """Each keepalive takes ``delay_s``; counts them in flight; ``expired`` leases are gone."""

    def __init__(self, delay_s: float = 0.02) -> None:
        super().__init__()
        self.delay_s, self.in_flight, self.most, self.num = delay_s, 0, 0, 0
        self.expired: set[int] = set()
        self.is_down = False
        self.only: set[int] | None = None  # the leases counted (None: all)

    async def refresh_lease(self, lease_id: int) -> bool:
        if self.is_down:
            raise StoreError("etcd unreachable")
        if self.only is not None and lease_id not in self.only:
            return await super().refresh_lease(lease_id)  # the election's own
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        self.num += 1
        return lease_id not in self.expired and await super().refresh_lease(lease_id)


def report(iid: str) -> pb.InstanceReport:
    return pb.InstanceReport(instance_id=iid, role="decode", pool="decode", process_state="running",
                             probe_ok=True, engine_address=f"{iid}:1", kv_endpoint=f"{iid}:2", kv_transport="tcp")


async def written_cluster(store: SlowLeases, num: int) -> tuple[Cluster, StatePersister]:
    cluster = Cluster(ClusterSettings(), now_s=0.0)
    cluster.apply_heartbeat("a", [report(f"d{i}") for i in range(num)], 0.0)
    persister = StatePersister(store, "/pdserve/t", lease_ttl_s=30)
    await persister.flush(cluster, 0.0)
    return cluster, persister


def test_due_leases_are_kept_alive_many_at_once_and_an_expired_one_is_written_again():
    async def go():
        store = SlowLeases()
        cluster, persister = await written_cluster(store, 100)
        await persister.keep_leases(cluster, 5.0)  # not due: a third of the TTL has not passed
        assert store.num == 0
        for rec in cluster.records.values():
            rec.last_heartbeat_s = 10.0
        cluster.records["d7"].last_heartbeat_s = 5.0  # not heard for two intervals: let it lapse
        store.expired.add(cluster.records["d3"].lease_id)
        await persister.keep_leases(cluster, 10.5)
        assert store.num == 99 and store.most == persist.LEASE_CONCURRENCY
        assert cluster.records["d3"].lease_id == 0 and cluster.dirty == {"d3"}
        await persister.flush(cluster, 10.5)
        assert cluster.records["d3"].lease_id != 0 and not cluster.dirty  # written under a new lease
        assert all(r.lease_refreshed_s == 10.5 for i, r in cluster.records.items() if i != "d7")

    asyncio.run(go())


def test_a_store_outage_during_keepalives_is_noted_like_a_flushs():
    async def go():
        store = SlowLeases()
        cluster, persister = await written_cluster(store, 3)
        for rec in cluster.records.values():
            rec.last_heartbeat_s = 10.0
        store.is_down = True
        await persister.keep_leases(cluster, 10.5)
        assert not persister.is_store_ok  # the next flush writes everything again

    asyncio.run(go())


def test_the_view_is_published_before_the_keepalives():
    async def go():
        now = [0.0]
        store = SlowLeases(delay_s=0.5)
        store.only = set()  # the election's keepalives at once
        leader = Controller(ControllerSettings(cluster_name="c", lease_ttl_s=30, leader_ttl_s=60), store, clock=lambda: now[0])
        await leader.start()
        await leader.heartbeat(pb.HeartbeatRequest(agent_id="a", instances=[report("d0"), report("d1")]))
        for _ in range(200):
            if [i.instance_id for i in leader.view().instances] == ["d0", "d1"]:
                break
            await asyncio.sleep(0.01)
        store.only = {r.lease_id for r in leader.cluster.records.values()}
        now[0] = 11.0  # both leases due (a third of 30 s), and d1's engine exits
        gone = report("d1")
        gone.process_state, gone.probe_ok = "exited", False
        await leader.heartbeat(pb.HeartbeatRequest(agent_id="a", instances=[report("d0"), gone]))
        for _ in range(200):
            if store.in_flight:
                break
            await asyncio.sleep(0.005)
        in_flight, view = store.in_flight, [i.instance_id for i in leader.view().instances]
        await leader.stop()
        assert in_flight, "no keepalive was due"
        assert view == ["d0"], view  # out while they are in flight

    asyncio.run(go())
