"""Both stores behave alike (leases, compare-and-create, prefixes); the election hands
over when a leader resigns or its lease lapses; a new leader loads the last state."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.controller.cluster import ClusterSettings
from pdserve.controller.election import Election
from pdserve.controller.health import InstanceRecord
from pdserve.controller.persist import StatePersister
from pdserve.controller.store import Fence, FencedError, MemoryStore, StoreError, open_store
from tests.etcd import EtcdServer


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data").start()
    yield server
    server.stop()


@pytest.fixture(params=["memory", "etcd"])
def store_url(request):
    if request.param == "memory":
        return "memory://"
    return request.getfixturevalue("etcd").url


def test_store_contract(store_url):
    async def go():
        store = open_store(store_url)
        lease = await store.grant_lease(2)
        assert await store.create_if_absent("/t/leader", "a", lease)
        assert not await store.create_if_absent("/t/leader", "b", lease)
        await store.put("/t/i/x", "1", lease)
        await store.put("/t/meta", "m")
        assert await store.get_prefix("/t/i/") == {"/t/i/x": "1"}
        assert await store.refresh_lease(lease)
        await store.revoke_lease(lease)
        assert await store.get("/t/leader") is None and await store.get_prefix("/t/i/") == {}
        assert not await store.refresh_lease(lease)
        assert await store.get("/t/meta") == "m"
        await store.delete("/t/meta")
        await store.close()

    asyncio.run(go())


def test_fenced_writes_apply_only_while_the_key_keeps_its_create_revision(store_url):
    async def go():
        store = open_store(store_url)
        first = await store.grant_lease(5)
        assert await store.create_if_absent("/f/leader", "a", first)
        entry = await store.get_entry("/f/leader")
        assert (entry.value, entry.lease) == ("a", first)
        term = Fence("/f/leader", entry.create_revision)
        await store.put("/f/meta", "by a", fence=term)
        await store.put("/f/leader", "a", first)  # a rewrite keeps the create revision
        await store.delete("/f/meta", fence=term)
        await store.revoke_lease(first)           # a's key goes; b is elected
        assert await store.create_if_absent("/f/leader", "b", await store.grant_lease(5))
        assert (await store.get_entry("/f/leader")).create_revision != term.revision
        with pytest.raises(FencedError):
            await store.put("/f/meta", "late write by a", fence=term)
        with pytest.raises(FencedError):
            await store.delete("/f/leader", fence=term)
        assert await store.get("/f/meta") is None and await store.get("/f/leader") == "b"
        assert await store.get_entry("/f/none") is None
        await store.close()

    asyncio.run(go())


def test_memory_lease_expires_on_its_clock():
    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])

    async def go():
        lease = await store.grant_lease(5)
        await store.put("/k", "v", lease)
        now[0] = 4.0
        assert await store.refresh_lease(lease)
        now[0] = 8.5
        assert await store.get("/k") == "v"
        now[0] = 9.0
        assert await store.get("/k") is None
        with pytest.raises(StoreError):
            await store.put("/k", "v", lease)

    asyncio.run(go())


def test_memory_leases_of_different_ttls_expire_each_on_time_however_refreshed():
    """The store scans its leases only once the earliest expiry passed: a refresh, a
    revoke or a new lease in between never lets one outlive its expiry."""
    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])

    async def go():
        leases = {ttl: await store.grant_lease(ttl) for ttl in (10, 20, 30)}
        for ttl, lease in leases.items():
            await store.put(f"/k{ttl}", "v", lease)
        now[0] = 9.9
        assert await store.get_prefix("/k") == {"/k10": "v", "/k20": "v", "/k30": "v"}
        now[0] = 10.0
        assert await store.get_prefix("/k") == {"/k20": "v", "/k30": "v"}
        assert await store.refresh_lease(leases[20])   # 20 -> 30
        short = await store.grant_lease(2)              # expires at 12, before every other
        await store.put("/short", "v", short)
        now[0] = 12.0
        assert await store.get("/short") is None and await store.get("/k20") == "v"
        await store.revoke_lease(leases[30])
        assert await store.get_prefix("/k") == {"/k20": "v"}
        now[0] = 29.9
        assert await store.get("/k20") == "v"
        now[0] = 30.0
        assert await store.get_prefix("/k") == {} and not await store.refresh_lease(leases[20])

    asyncio.run(go())


def test_unreachable_etcd_is_a_store_error():
    async def go():
        store = open_store("etcd://127.0.0.1:9")
        with pytest.raises(StoreError):
            await store.get("/x")
        await store.close()

    asyncio.run(go())


def test_standby_takes_over_when_the_leader_resigns_or_dies(etcd):
    async def go():
        changes = []

        async def note(name, is_leader):
            changes.append((name, is_leader))

        stores = [open_store(etcd.url), open_store(etcd.url)]
        a = Election(stores[0], "/e/leader", "a", 2, lambda v: note("a", v))
        b = Election(stores[1], "/e/leader", "b", 2, lambda v: note("b", v))
        await a.step()
        await b.step()
        assert a.is_leader and not b.is_leader and b.leader == "a"
        await a.resign()  # clean: immediate
        await b.step()
        assert b.is_leader
        await a.step()
        assert not a.is_leader and a.leader == "b"
        # b dies without resigning: its lease lapses after the TTL
        await asyncio.sleep(3.2)
        await a.step()
        assert a.is_leader
        await b.step()  # the old leader notices and steps down
        assert not b.is_leader
        assert ("b", False) in changes
        for s in stores:
            await s.close()

    asyncio.run(go())


def test_new_leader_loads_records_and_mode(etcd):
    async def go():
        store = open_store(etcd.url)
        settings = ClusterSettings()
        old = StatePersister(store, "/p/c1", lease_ttl_s=10)
        cluster = await old.load(settings, 0.0)
        cluster.records["d0"] = InstanceRecord("d0", pool="decode", assigned_role="decode",
                                               role="hybrid", health="READY", engine_address="e:1")
        cluster.dirty.add("d0")
        cluster.mode.mode, cluster.mode.missing_roles = "FALLBACK", ["prefill"]
        cluster.meta_dirty = True
        await old.flush(cluster, 0.0)
        new = await StatePersister(store, "/p/c1", lease_ttl_s=10).load(settings, 100.0)
        rec = new.records["d0"]
        assert (rec.role, rec.health, rec.engine_address, rec.last_heartbeat_s) == ("hybrid", "READY", "e:1", 100.0)
        assert new.mode.mode == "FALLBACK" and new.mode.missing_roles == ["prefill"]
        await store.close()

    asyncio.run(go())
