"""The Controller watcher against a tiny fake Controller: views flow into the registry,
and the watch re-opens after the Controller goes away."""

from __future__ import annotations

import asyncio

from pdserve.api.proto import controller_pb2 as cpb
from pdserve.api.proto import controller_pb2_grpc as cpb_grpc
from pdserve.coordinator.instances import InstanceRegistry
from pdserve.coordinator.watcher import ControllerWatcher
from tests.unit.coordinator.harness import serve_controller


class FakeController(cpb_grpc.ControllerServicer):
    def __init__(self) -> None:
        self.views: asyncio.Queue[cpb.ClusterView] = asyncio.Queue()
        self.num_watches = 0

    async def WatchView(self, request, context):
        self.num_watches += 1
        while True:
            yield await self.views.get()


def view(version: int, mode: str = "PD", *roles: str) -> cpb.ClusterView:
    return cpb.ClusterView(version=version, mode=mode, fallback_reason="no decode" if mode != "PD" else "",
                           instances=[cpb.InstanceView(
                               instance_id=f"i{k}", role=r, health="READY",
                               engine_address=f"127.0.0.1:{1000 + k}", kv_endpoint=f"127.0.0.1:{2000 + k}",
                               kv_compat_hash="h", load=cpb.InstanceLoad(num_running=k))
                               for k, r in enumerate(roles)])


async def wait_until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_views_replace_the_registry_and_the_watch_reconnects():
    async def go():
        fake = FakeController()
        server, port = await serve_controller(fake)
        registry = InstanceRegistry()
        watcher = ControllerWatcher(registry, f"127.0.0.1:{port}", "c1")
        await fake.views.put(view(1, "PD", "prefill", "decode"))
        await watcher.start(first_view_timeout_s=5)
        pools = registry.pools()
        assert [i.instance_id for i in pools.prefill] == ["i0"]
        assert pools.decode[0].num_running == 1 and pools.decode[0].kv_endpoint == "127.0.0.1:2001"
        await fake.views.put(view(2, "FALLBACK", "hybrid"))
        await wait_until(lambda: registry.mode == "FALLBACK")
        assert registry.fallback_reason == "no decode" and len(registry.pools().hybrid) == 1
        # The Controller restarts on the same port: the watcher opens a new watch.
        await server.stop(grace=None)
        fake2 = FakeController()
        server, _ = await serve_controller(fake2, port)
        await fake2.views.put(view(3, "PD", "prefill", "decode", "decode"))
        await wait_until(lambda: len(registry.pools().decode) == 2)
        assert registry.mode == "PD" and watcher.num_views == 3
        await watcher.stop()
        await server.stop(grace=None)

    asyncio.run(go())


def test_a_view_writes_every_field_and_a_load_only_view_keeps_the_members():
    """``views_from_view`` reads the message by position: each field lands on its own
    name; a view changing the load alone keeps the pools (``members_version``) and moves
    the least loaded engine; one changing a member field, a draining instance, bumps it."""
    def instance(k: int, running: int, health: str = "READY") -> cpb.InstanceView:
        return cpb.InstanceView(
            instance_id=f"d{k}", role="decode", health=health, engine_address=f"127.0.0.1:{1000 + k}",
            kv_endpoint=f"127.0.0.1:{2000 + k}", kv_compat_hash=f"h{k}", max_model_len=4096 + k,
            peers_checked_version=10 + k, peers_listed_version=20 + k,
            load=cpb.InstanceLoad(num_running=running, num_waiting=30 + k, num_kv_blocks_used=40 + k,
                                  num_kv_blocks_free=50 + k))

    async def go():
        registry = InstanceRegistry()
        watcher = ControllerWatcher(registry, "127.0.0.1:1", "c1")
        watcher.apply(cpb.ClusterView(version=1, instances=[instance(0, 1), instance(1, 9)]))
        d1 = registry.get("d1")
        assert (d1.address, d1.role, d1.kv_endpoint, d1.kv_compat_hash, d1.healthy, d1.draining) == (
            "127.0.0.1:1001", "decode", "127.0.0.1:2001", "h1", True, False)
        assert (d1.num_running, d1.num_waiting, d1.num_kv_blocks_used, d1.num_kv_blocks_free) == (9, 31, 41, 51)
        assert (d1.max_model_len, d1.peers_checked_version, d1.peers_listed_version, d1.block_size) == (
            4097, 11, 21, 0)
        pools, members = registry.pools(), registry.members_version
        assert pools.decode.order.least(0).instance_id == "d0"
        d1.num_inflight = 5  # a leg of ours on it: kept across views
        watcher.apply(cpb.ClusterView(version=1, instances=[instance(0, 40), instance(1, 2)]))
        assert registry.get("d1") is d1 and d1.num_running == 2 and d1.num_inflight == 5
        assert d1.inflight_at_report == 5  # a new report of its load
        assert registry.members_version == members and registry.pools() is pools
        assert pools.decode.order.least(0).instance_id == "d1"
        watcher.apply(cpb.ClusterView(version=2, instances=[instance(0, 40, "DRAINING"), instance(1, 2)]))
        assert registry.get("d0").draining and registry.members_version == members + 1
        assert [i.instance_id for i in registry.pools().decode] == ["d1"]

    asyncio.run(go())
