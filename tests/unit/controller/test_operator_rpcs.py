"""The Controller's RPCs for the operator: Drain, ListReplacements/AckReplacement, ForgetCluster.

One Controller on a memory store behind its real gRPC server; a fake agent heartbeats.
"""

from __future__ import annotations

import asyncio

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.controller.cluster import ClusterSettings
from pdserve.controller.core import Controller, ControllerSettings
from pdserve.controller.service import create_grpc_server
from pdserve.controller.store import MemoryStore
from pdserve.runtime.security import SecuritySettings, create_channel


def report(instance_id: str, num_running: int = 0, state: str = "running") -> pb.InstanceReport:
    return pb.InstanceReport(instance_id=instance_id, role="decode", pool="decode", process_state=state,
                             engine_address="10.0.0.1:1", kv_endpoint="10.0.0.1:2", probe_ok=True,
                             load=pb.InstanceLoad(num_running=num_running))


async def scenario(check) -> None:
    store = MemoryStore()
    controller = Controller(ControllerSettings(cluster_name="c", cluster=ClusterSettings()), store)
    await controller.start()
    server, port = await create_grpc_server(controller, "127.0.0.1:0", SecuritySettings())
    try:
        async with create_channel(f"127.0.0.1:{port}") as channel:
            await check(pb_grpc.ControllerStub(channel), controller, store)
    finally:
        await server.stop(None)
        await controller.stop()


def test_drain_is_sent_once_and_reports_idle_after_a_later_heartbeat():
    async def check(stub, controller, store):
        reply = await stub.Drain(pb.DrainRequest(instance_id="c-decode-0"))
        assert not reply.is_known and reply.is_drained
        await stub.Heartbeat(pb.HeartbeatRequest(agent_id="a", instances=[report("c-decode-0", 2)]))
        first = await stub.Drain(pb.DrainRequest(instance_id="c-decode-0", deadline_s=5))
        again = await stub.Drain(pb.DrainRequest(instance_id="c-decode-0", deadline_s=5))
        assert first.is_known and not first.is_drained and not again.is_drained
        hb = await stub.Heartbeat(pb.HeartbeatRequest(agent_id="a", instances=[report("c-decode-0", 2)]))
        assert [(c.kind, c.instance_id, c.deadline_s) for c in hb.commands] == [("drain", "c-decode-0", 5)]
        assert not (await stub.Drain(pb.DrainRequest(instance_id="c-decode-0"))).is_drained
        await asyncio.sleep(0.01)
        hb = await stub.Heartbeat(pb.HeartbeatRequest(agent_id="a", instances=[report("c-decode-0", 0)]))
        assert not hb.commands  # sent once
        reply = await stub.Drain(pb.DrainRequest(instance_id="c-decode-0"))
        assert reply.is_drained and reply.num_running == 0

    asyncio.run(scenario(check))


def test_replacements_are_listed_and_acknowledged():
    async def check(stub, controller, store):
        await stub.Heartbeat(pb.HeartbeatRequest(agent_id="a", instances=[report("c-decode-0")]))
        controller.cluster.records["c-decode-0"].replacement_requested = True
        await store.put("/pdserve/c/replace/c-decode-0", '{"instance": "c-decode-0", "reason": "3 failures"}')
        listed = await stub.ListReplacements(pb.ListReplacementsRequest())
        assert [(r.instance_id, r.reason) for r in listed.replacements] == [("c-decode-0", "3 failures")]
        await stub.AckReplacement(pb.AckReplacementRequest(instance_id="c-decode-0"))
        assert not (await stub.ListReplacements(pb.ListReplacementsRequest())).replacements
        assert not controller.cluster.records["c-decode-0"].replacement_requested

    asyncio.run(scenario(check))


def test_forget_cluster_deletes_every_key_but_the_leader_and_writes_no_more():
    async def check(stub, controller, store):
        await stub.Heartbeat(pb.HeartbeatRequest(agent_id="a", instances=[report("c-decode-0")]))
        await controller.persister.flush(controller.cluster, controller.clock())
        await store.put("/pdserve/c/replace/c-decode-0", "{}")
        assert await store.get_prefix("/pdserve/c/instances/")
        reply = await stub.ForgetCluster(pb.ForgetClusterRequest())
        assert reply.num_keys_deleted >= 2
        await asyncio.sleep(0.6)  # a tick of the leader loop
        assert list(await store.get_prefix("/pdserve/c/")) == ["/pdserve/c/leader"]

    asyncio.run(scenario(check))
