"""The Coordinator's Controller watcher against two fake Controller replicas
(``--controller A,B``): it skips the standby, follows the leader, and moves to the
other replica at once when the leader dies and the standby takes over."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.coordinator.instances import InstanceRegistry
from pdserve.coordinator.watcher import ControllerWatcher


class Replica(pb_grpc.ControllerServicer):
    """A Controller replica: a standby refuses, the leader streams its view every 50 ms."""

    def __init__(self, name: str) -> None:
        self.name, self.is_leader, self.num_refused = name, False, 0

    async def WatchView(self, request, context):
        while True:
            if not self.is_leader:
                self.num_refused += 1
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "standby; leader is elsewhere")
            yield pb.ClusterView(leader=self.name, mode="PD", instances=[pb.InstanceView(
                instance_id=f"d-{self.name}", role="decode", health="READY", engine_address="127.0.0.1:1")])
            await asyncio.sleep(0.05)


async def serve(replica: Replica, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    pb_grpc.add_ControllerServicer_to_server(replica, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def eventually(predicate, timeout_s: float) -> float:
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not predicate():
        assert loop.time() - started < timeout_s, "condition not met in time"
        await asyncio.sleep(0.01)
    return loop.time() - started


def test_the_watch_skips_the_standby_and_follows_the_leader_across_a_handover():
    async def go():
        a, b = Replica("a"), Replica("b")
        (server_a, port_a), (server_b, port_b) = await serve(a), await serve(b)
        b.is_leader = True
        registry = InstanceRegistry()
        watcher = ControllerWatcher(registry, f"127.0.0.1:{port_a}, 127.0.0.1:{port_b}", "c1")
        assert watcher.addresses == (f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}")

        def ids() -> list[str]:
            return [i.instance_id for i in registry.all()]

        await watcher.start(first_view_timeout_s=5)
        assert ids() == ["d-b"] and a.num_refused == 1  # asked the standby once, moved on at once
        await server_b.stop(None)                        # the leader dies ...
        await asyncio.sleep(0.3)
        a.is_leader = True                               # ... and the standby takes over
        followed_s = await eventually(lambda: ids() == ["d-a"], timeout_s=5)
        assert followed_s < 1.5                          # the backoff stays short
        num_views = watcher.num_views
        await eventually(lambda: watcher.num_views >= num_views + 3, timeout_s=2)  # the stream stays open
        await watcher.stop()
        await server_a.stop(None)

    asyncio.run(go())
