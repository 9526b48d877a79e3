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
