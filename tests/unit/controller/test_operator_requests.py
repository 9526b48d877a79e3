"""The operator's requests as public operations: the cluster model decides (drain,
replacement acknowledgement, forget), the gRPC servicer only translates, and a
standby refuses every one of them with FAILED_PRECONDITION naming the leader."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.controller.cluster import Cluster, ClusterSettings
from pdserve.controller.core import Controller, ControllerSettings
from pdserve.controller.service import create_grpc_server
from pdserve.controller.store import MemoryStore
from pdserve.runtime.security import SecuritySettings, create_channel


def report(iid: str, num_running: int = 0) -> pb.InstanceReport:
    return pb.InstanceReport(instance_id=iid, role="decode", pool="decode", process_state="running",
                             probe_ok=True, engine_address=f"{iid}:1", kv_endpoint=f"{iid}:2",
                             load=pb.InstanceLoad(num_running=num_running))


def test_a_drain_is_queued_once_delivered_and_then_waits_for_an_idle_heartbeat():
    c = Cluster(ClusterSettings(), now_s=0.0)
    assert not c.request_drain("d0", 5.0).is_known
    c.apply_heartbeat("agent", [report("d0", num_running=1)], 1.0)
    queued = c.request_drain("d0", 5.0)
    assert queued.is_known and not queued.is_drained and queued.num_running == 1
    assert not c.request_drain("d0", 5.0).is_drained  # asked again: nothing more queued
    delivered = c.apply_heartbeat("agent", [report("d0", num_running=1)], 2.0)
    assert [(x.kind, x.deadline_s) for x in delivered] == [("drain", 5.0)]
    assert not c.request_drain("d0", 5.0).is_drained  # the delivering heartbeat does not count
    assert c.apply_heartbeat("agent", [report("d0")], 3.0) == []
    assert c.request_drain("d0", 5.0).is_drained


def test_an_instance_forgotten_and_registered_again_is_drained_afresh():
    """A new instance under an old name (a recreated Pod) gets its own drain command; the
    earlier instance's drain says nothing about it."""
    c = Cluster(ClusterSettings(forget_after_s=5.0), now_s=0.0)
    c.started_s = -100.0  # past the new-leader grace window
    c.apply_heartbeat("agent", [report("d0")], 1.0)
    c.request_drain("d0", 5.0)
    assert [x.kind for x in c.apply_heartbeat("agent", [report("d0")], 2.0)] == ["drain"]
    c.tick(40.0)  # silent: FAILED, then forgotten
    assert "d0" not in c.records
    c.apply_heartbeat("agent", [report("d0", num_running=2)], 41.0)
    again = c.request_drain("d0", 5.0)
    assert not again.is_drained and again.num_running == 2
    assert [x.kind for x in c.apply_heartbeat("agent", [report("d0", num_running=2)], 42.0)] == ["drain"]


def test_a_drained_instance_that_goes_silent_left_and_is_not_a_failover():
    c = Cluster(ClusterSettings(), now_s=0.0)
    c.started_s = -100.0
    c.apply_heartbeat("agent", [report("d0"), report("d1")], 1.0)
    c.request_drain("d0", 5.0)
    c.apply_heartbeat("agent", [report("d0"), report("d1")], 2.0)  # delivers the drain
    for now in (3.0, 4.0, 5.0, 6.0, 7.0):  # d0 stopped; d1 beats on
        c.apply_heartbeat("agent", [report("d1")], now)
        c.tick(now)
    assert "d0" not in c.records and "d0" in c.removed
    assert c.num_failovers == 0 and any("d0: forgotten (stopped after its drain)" in e for e in c.events)
    for now in range(8, 30):  # silence without a drain still fails over
        c.tick(float(now))
    assert c.records["d1"].health == "FAILED" and c.num_failovers == 1


def test_acknowledging_a_replacement_clears_the_failure_history_and_forget_drops_all():
    c = Cluster(ClusterSettings(), now_s=0.0)
    c.apply_heartbeat("agent", [report("d0")], 1.0)
    rec = c.records["d0"]
    rec.replacement_requested, rec.failures = True, [1.0, 2.0]
    c.dirty.clear()
    c.clear_replacement("d0")
    c.clear_replacement("gone")  # unknown: nothing to do
    assert not rec.replacement_requested and rec.failures == [] and c.dirty == {"d0"}
    c.replacements.append(("d0", "x"))
    c.forget_all()
    assert not (c.records or c.dirty or c.removed or c.replacements or c.meta_dirty)


def test_a_standby_refuses_every_rpc_naming_the_leader():
    async def go():
        store = MemoryStore()
        await store.create_if_absent("/pdserve/c/leader", "other:1")
        controller = Controller(ControllerSettings(cluster_name="c", identity="me:2"), store)
        await controller.start()
        server, port = await create_grpc_server(controller, "127.0.0.1:0", SecuritySettings())
        codes = {}
        try:
            async with create_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.ControllerStub(channel)
                for name, request in [("Heartbeat", pb.HeartbeatRequest(agent_id="a")),
                                      ("GetView", pb.WatchViewRequest()),
                                      ("Drain", pb.DrainRequest(instance_id="d0")),
                                      ("ListReplacements", pb.ListReplacementsRequest()),
                                      ("AckReplacement", pb.AckReplacementRequest(instance_id="d0")),
                                      ("ForgetCluster", pb.ForgetClusterRequest())]:
                    with pytest.raises(grpc.aio.AioRpcError) as exc:
                        await getattr(stub, name)(request, timeout=5)
                    codes[name] = (exc.value.code(), exc.value.details())
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    async for _ in stub.WatchView(pb.WatchViewRequest(), timeout=5):
                        pass
                codes["WatchView"] = (exc.value.code(), exc.value.details())
        finally:
            await server.stop(None)
            await controller.stop()
        return codes

    codes = asyncio.run(go())
    assert set(codes.values()) == {(grpc.StatusCode.FAILED_PRECONDITION, "standby; leader is other:1")}
    assert len(codes) == 7
