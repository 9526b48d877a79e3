"""Election fencing with two Controller replicas on one store: a leader cut off from
the store stops acting before its lease can expire (so the standby is never elected
while it still acts), also while a store call hangs; the stale leader's writes are
refused by the fence; a leader whose write is refused steps down at once."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.api.proto import controller_pb2 as pb
from pdserve.controller.core import Controller, ControllerSettings, NotLeader
from pdserve.controller.store import FencedError, MemoryStore, Store, StoreError

KEY = "/pdserve/c/leader"


class Partition(Store):
    """One replica's way to the shared store: ``is_cut`` fails its calls, ``hang()`` holds them."""

    def __init__(self, inner: Store) -> None:
        self.inner, self.is_cut = inner, False
        self.released = asyncio.Event()
        self.released.set()

    def hang(self) -> None:
        self.released.clear()

    async def _reach(self) -> Store:
        await self.released.wait()
        if self.is_cut:
            raise StoreError("partitioned")
        return self.inner

    async def grant_lease(self, ttl_s):
        return await (await self._reach()).grant_lease(ttl_s)

    async def refresh_lease(self, lease_id):
        return await (await self._reach()).refresh_lease(lease_id)

    async def revoke_lease(self, lease_id):
        return await (await self._reach()).revoke_lease(lease_id)

    async def put(self, key, value, lease=None, fence=None):
        return await (await self._reach()).put(key, value, lease, fence)

    async def get(self, key):
        return await (await self._reach()).get(key)

    async def get_entry(self, key):
        return await (await self._reach()).get_entry(key)

    async def get_prefix(self, prefix):
        return await (await self._reach()).get_prefix(prefix)

    async def delete(self, key, fence=None):
        return await (await self._reach()).delete(key, fence)

    async def create_if_absent(self, key, value, lease=None):
        return await (await self._reach()).create_if_absent(key, value, lease)


def replica(identity: str, store: Store, clock) -> Controller:
    return Controller(ControllerSettings(cluster_name="c", identity=identity, leader_ttl_s=5), store, clock)


def heartbeat() -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(agent_id="agent", instances=[pb.InstanceReport(
        instance_id="d0", role="decode", pool="decode", process_state="running", probe_ok=True,
        engine_address="10.0.0.1:1", kv_endpoint="10.0.0.1:2")])


async def acts_as_leader(controller: Controller) -> bool:
    """What a caller sees: the replica answers a heartbeat (and would send commands)."""
    try:
        await controller.heartbeat(heartbeat())
        return True
    except NotLeader:
        return False


def test_a_cut_off_leader_steps_down_before_the_standby_is_elected_and_its_writes_are_refused():
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    shared = MemoryStore(clock)
    path = Partition(shared)
    a, b = replica("a", path, clock), replica("b", shared, clock)

    async def go():
        await a.election.step()
        await b.election.step()
        assert await acts_as_leader(a) and not await acts_as_leader(b) and b.election.leader == "a"
        await a._commit(a.cluster, now[0])
        term, cluster = a.election.fence, a.cluster
        path.is_cut = True
        timeline = []
        for t in (1.0, 2.0, 3.0, 4.0, 4.49, 4.5, 4.9, 5.0, 5.1):
            now[0] = t
            with pytest.raises(StoreError):
                await a.election.step()
            await b.election.step()
            timeline.append((t, await acts_as_leader(a), await acts_as_leader(b)))
        assert not any(a_acts and b_acts for _, a_acts, b_acts in timeline)
        assert [t for t, a_acts, _ in timeline if a_acts][-1] == 4.49  # 0.9 of the TTL after its renewal
        assert [t for t, _, b_acts in timeline if b_acts][0] == 5.0     # when the lease expired
        with pytest.raises(NotLeader):
            a.view()
        with pytest.raises(FencedError):
            a.election.write_fence()

        path.is_cut = False  # the stale leader reaches the store again
        with pytest.raises(FencedError):
            await shared.put("/pdserve/c/meta", "stale", fence=term)
        cluster.meta_dirty = True
        with pytest.raises(FencedError):
            await a.persister.flush(cluster, now[0])
        assert await shared.get("/pdserve/c/meta") != "stale"
        await a.election.step()
        assert a.cluster is None and a.election.leader == "b" and b.is_leader

    asyncio.run(go())


def test_a_leader_whose_write_is_refused_steps_down_at_once():
    now = [0.0]
    store = MemoryStore(lambda: now[0])
    a = replica("a", store, lambda: now[0])

    async def go():
        await a.election.step()
        assert a.is_leader
        # etcd lost the key (restored from an old backup, deleted by hand) and b took it
        await store.delete(KEY)
        assert await store.create_if_absent(KEY, "b", await store.grant_lease(5))
        await a.heartbeat(heartbeat())
        await a._commit(a.cluster, now[0])
        assert not a.is_leader and a.cluster is None
        assert await store.get_prefix("/pdserve/c/instances/") == {}  # nothing written
        with pytest.raises(NotLeader):
            await a.forget_cluster()

    asyncio.run(go())


def test_a_hung_store_call_does_not_delay_the_step_down():
    """The deadline is kept by the watchdog, not by the renewal that never returns."""
    async def go():
        path = Partition(MemoryStore())
        a = Controller(ControllerSettings(cluster_name="c", identity="a", leader_ttl_s=1), path)
        await a.start()
        assert a.is_leader
        loop = asyncio.get_running_loop()
        path.hang()
        hung_at = loop.time()
        while a.cluster is not None:
            assert loop.time() - hung_at < 2.0, "still leading"
            await asyncio.sleep(0.01)
        assert loop.time() - hung_at <= 0.9 + 0.1
        with pytest.raises(NotLeader):
            a.view()
        path.released.set()
        await a.stop()

    asyncio.run(go())
