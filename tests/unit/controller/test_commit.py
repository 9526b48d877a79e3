"""Write, then publish: the view a leader serves is always in the store first, so a
successor loading the store after a crash at any moment serves the same view."""

from __future__ import annotations

import asyncio

from pdserve.api.proto import controller_pb2 as pb
from pdserve.controller.cluster import ClusterSettings
from pdserve.controller.core import Controller, ControllerSettings
from pdserve.controller.persist import StatePersister
from pdserve.controller.store import MemoryStore


class GatedStore(MemoryStore):
    """A store whose writes wait while ``gate`` is clear (a slow or stalled etcd)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()

    async def put(self, key: str, value: str, lease: int | None = None, fence=None) -> None:
        await self.gate.wait()
        await super().put(key, value, lease, fence)


def heartbeat(role: str) -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(agent_id="a", instances=[pb.InstanceReport(
        instance_id="d0", role=role, pool="decode", process_state="running", probe_ok=True,
        engine_address="10.0.0.1:1", kv_endpoint="10.0.0.1:2", kv_transport="tcp")])


def roles(view: pb.ClusterView) -> dict[str, str]:
    return {i.instance_id: i.role for i in view.instances}


async def eventually(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


def test_a_change_is_published_only_after_it_was_written():
    async def go():
        store = GatedStore()
        leader = Controller(ControllerSettings(cluster_name="c"), store)
        await leader.start()
        assert leader.is_leader

        async def successor_view() -> dict[str, str]:
            cluster = await StatePersister(store, "/pdserve/c", 30).load(ClusterSettings(), 0.0)
            return roles(cluster.view("successor"))

        await leader.heartbeat(heartbeat("hybrid"))
        await eventually(lambda: roles(leader.view()) == {"d0": "hybrid"})
        store.gate.clear()                              # etcd stalls ...
        await leader.heartbeat(heartbeat("decode"))     # ... while the switch to decode completes
        await asyncio.sleep(0.3)
        assert roles(leader.view()) == {"d0": "hybrid"}  # not written, so not shown
        assert await successor_view() == {"d0": "hybrid"}  # a crash now hands over what clients saw
        store.gate.set()
        await eventually(lambda: roles(leader.view()) == {"d0": "decode"})
        assert await successor_view() == {"d0": "decode"}
        await leader.stop()

    asyncio.run(go())


def test_a_change_made_while_its_record_is_written_is_written_too():
    async def go():
        store = GatedStore()
        persister = StatePersister(store, "/pdserve/c", 30)
        cluster = await persister.load(ClusterSettings(), 0.0)
        cluster.apply_heartbeat("a", heartbeat("hybrid").instances, 0.0)
        store.gate.clear()
        flush = asyncio.create_task(persister.flush(cluster, 0.0))
        await asyncio.sleep(0.05)                        # the write of "hybrid" is in flight
        cluster.apply_heartbeat("a", heartbeat("decode").instances, 0.1)
        store.gate.set()
        await flush
        loaded = await persister.load(ClusterSettings(), 1.0)
        assert loaded.records["d0"].role == "decode" and not cluster.dirty

    asyncio.run(go())
