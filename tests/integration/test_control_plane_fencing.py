"""Election fencing on a real etcd: a partition between the leader and etcd (the
leader reaches etcd through a proxy the test hangs; the standby reaches etcd
directly) never gives two leaders acting at once.

Both replicas serve their real gRPC service; the test asks each, every few
milliseconds, as a NodeAgent would (Heartbeat: answered by the leader only, with
its commands). The old leader refuses before the standby starts answering; once
the partition heals, a write the stale leader sends with its old term's fence is
refused by etcd and changes nothing, and the old leader follows the new one.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.controller.cluster import ClusterSettings
from pdserve.controller.core import Controller, ControllerSettings
from pdserve.controller.election import LEAD_FRACTION
from pdserve.controller.health import HealthThresholds
from pdserve.controller.service import create_grpc_server
from pdserve.controller.store import FencedError, open_store
from pdserve.runtime.security import SecuritySettings, create_channel
from tests.etcd import EtcdServer, TcpProxy

LEADER_TTL_S = 2
SETTINGS = dict(cluster_name="f", leader_ttl_s=LEADER_TTL_S, lease_ttl_s=10,
                cluster=ClusterSettings(thresholds=HealthThresholds(interval_s=0.2)))


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "data").start()
    proxy = TcpProxy(server.client_port)
    yield server, proxy
    proxy.close()
    server.stop()


def heartbeat() -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(agent_id="agent", instances=[pb.InstanceReport(
        instance_id="d0", role="decode", pool="decode", process_state="running", probe_ok=True,
        engine_address="10.0.0.1:1", kv_endpoint="10.0.0.1:2")])


async def answers_as_leader(stub: pb_grpc.ControllerStub) -> bool:
    """Whether the Controller handled a Heartbeat as leader. Its deadline is loose: on a
    loaded machine an answer can take a while, and the timeline below keys each probe
    to when it was sent (the Controller handles it after that)."""
    try:
        await stub.Heartbeat(heartbeat(), timeout=5.0)
        return True
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
        return False


async def eventually(predicate, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await predicate():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_a_partitioned_leader_stops_before_the_standby_leads_and_cannot_write(etcd):
    server, proxy = etcd

    async def go():
        loop = asyncio.get_running_loop()
        old = Controller(ControllerSettings(identity="old", **SETTINGS), open_store(proxy.url))
        new = Controller(ControllerSettings(identity="new", **SETTINGS), open_store(server.url))
        servers, stubs, channels = [], [], []
        for controller in (old, new):
            await controller.start()
            grpc_server, port = await create_grpc_server(controller, "127.0.0.1:0", SecuritySettings())
            channel = create_channel(f"127.0.0.1:{port}")
            servers.append(grpc_server)
            channels.append(channel)
            stubs.append(pb_grpc.ControllerStub(channel))
        old_stub, new_stub = stubs
        try:
            assert old.is_leader and not new.is_leader
            assert await answers_as_leader(old_stub) and not await answers_as_leader(new_stub)
            etcd_view = open_store(server.url)
            await eventually(lambda: has_key(etcd_view, "/pdserve/f/instances/d0"), timeout_s=5)
            term = old.election.fence

            proxy.hang()
            hung_at = loop.time()
            timeline: list[tuple[float, bool, bool]] = []
            while not timeline or not timeline[-1][2]:  # (sent s, old leads, new leads)
                assert loop.time() - hung_at < 15, "the standby never took over"
                sent_s = loop.time() - hung_at
                old_acts, new_acts = await answers_as_leader(old_stub), await answers_as_leader(new_stub)
                timeline.append((sent_s, old_acts, new_acts))
                await asyncio.sleep(0.005)
            assert not any(old_acts and new_acts for _, old_acts, new_acts in timeline)
            old_stopped_s = next(t for t, old_acts, _ in timeline if not old_acts)
            new_started_s = next(t for t, _, new_acts in timeline if new_acts)
            print(f"old leader stopped {old_stopped_s:.2f}s into the partition, "
                  f"the standby led from {new_started_s:.2f}s")
            # No Heartbeat sent after its lead ran out (so handled after it) is served as leader.
            assert all(not old_acts for t, old_acts, _ in timeline
                       if t >= LEAD_FRACTION * LEADER_TTL_S + 0.2)
            assert all(not old_acts for t, old_acts, _ in timeline if t >= old_stopped_s)
            assert old_stopped_s < new_started_s

            proxy.heal()  # the stale leader reaches etcd again, with its old term
            with pytest.raises(FencedError):
                await old.store.put("/pdserve/f/meta", "stale", fence=term)
            with pytest.raises(FencedError):
                await old.store.delete("/pdserve/f/instances/d0", fence=term)
            assert await etcd_view.get("/pdserve/f/meta") != "stale"
            assert await has_key(etcd_view, "/pdserve/f/instances/d0")
            await eventually(lambda: follows(old, "new"), timeout_s=10)
            assert not await answers_as_leader(old_stub) and await answers_as_leader(new_stub)
            await etcd_view.close()
        finally:
            for channel in channels:
                await channel.close()
            for grpc_server in servers:
                await grpc_server.stop(None)
            for controller in (old, new):
                await controller.stop()

    asyncio.run(go())


async def has_key(store, key: str) -> bool:
    return await store.get(key) is not None


async def follows(controller: Controller, leader: str) -> bool:
    return controller.election.leader == leader and controller.election.is_store_ok
