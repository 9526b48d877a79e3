"""The Controller's gRPC service and HTTP endpoints (metrics, probes).

Translation only, between the network and ``Controller``: each RPC calls one
public method of the Controller and turns its answer into the reply; a standby's
``NotLeader`` becomes FAILED_PRECONDITION naming the leader (agents and
Coordinators then try the next address). Every call passes the cluster-token
interceptor (and mTLS when configured). ``create_grpc_server`` and
``create_http_app`` are factories; the CLI wires them.
"""

from __future__ import annotations

import functools

import grpc
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.controller.core import Controller, NotLeader
from pdserve.controller.health import DRAINING, FAILED, READY, STARTING, SUSPECT
from pdserve.runtime.http import alive, create_side_app, registry_of
from pdserve.runtime.security import SecuritySettings, add_port, server_interceptors


def leader_only(handler):
    """A unary RPC handler whose ``NotLeader`` is answered FAILED_PRECONDITION."""

    @functools.wraps(handler)
    async def translate(self, request, context):
        try:
            return await handler(self, request, context)
        except NotLeader as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    return translate


class ControllerServicer(pb_grpc.ControllerServicer):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    @leader_only
    async def Heartbeat(self, request, context):
        """Called by every NodeAgent each interval."""
        return await self.controller.heartbeat(request)

    @leader_only
    async def GetView(self, request, context):
        return self.controller.view()

    async def WatchView(self, request, context):
        """Called by each Coordinator: a stream of the routable view."""
        try:
            async for view in self.controller.watch():
                yield view
        except NotLeader as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    @leader_only
    async def Drain(self, request, context):
        """Called by the operator before it deletes a scaled-down instance."""
        d = self.controller.drain(request.instance_id, request.deadline_s)
        return pb.DrainResponse(is_known=d.is_known, is_drained=d.is_drained,
                                num_running=d.num_running, num_waiting=d.num_waiting, health=d.health)

    @leader_only
    async def ListReplacements(self, request, context):
        """Called by the operator on every reconcile."""
        out = pb.ListReplacementsResponse()
        for r in await self.controller.list_replacements():
            out.replacements.add(instance_id=r.instance_id, reason=r.reason,
                                 requested_unix_s=r.requested_unix_s)
        return out

    @leader_only
    async def AckReplacement(self, request, context):
        """Called by the operator once it deleted the instance's Pod for recreation."""
        await self.controller.acknowledge_replacement(request.instance_id)
        return pb.AckReplacementResponse()

    @leader_only
    async def ForgetCluster(self, request, context):
        """Called by the operator's delete handler after every engine Pod is gone."""
        return pb.ForgetClusterResponse(num_keys_deleted=await self.controller.forget_cluster())


async def create_grpc_server(controller: Controller, address: str,
                             security: SecuritySettings) -> tuple[grpc.aio.Server, int]:
    """A started server for ``controller`` on ``address``; returns it and the bound port."""
    server = grpc.aio.server(interceptors=server_interceptors(security))
    pb_grpc.add_ControllerServicer_to_server(ControllerServicer(controller), server)
    port = add_port(server, address, security)
    if not port:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    return server, port


class ControllerCollector:
    """``pdserve_controller_*`` metrics, read from the Controller at scrape time."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def collect(self):
        c = self.controller
        cluster = c.cluster if c.is_leader else None
        by = GaugeMetricFamily("pdserve_controller_instances", "Instances by role and health",
                               labels=["role", "state"])
        counts: dict[tuple[str, str], int] = {}
        for rec in (cluster.records.values() if cluster else ()):
            counts[(rec.role or rec.pool, rec.health)] = counts.get((rec.role or rec.pool, rec.health), 0) + 1
        for role in ("prefill", "decode", "hybrid"):
            for state in (STARTING, READY, SUSPECT, FAILED, DRAINING):
                by.add_metric([role, state], counts.get((role, state), 0))
        yield by
        failovers = CounterMetricFamily("pdserve_controller_failovers", "Instances that went FAILED")
        failovers.add_metric([], c.num_failovers + (cluster.num_failovers if cluster else 0))
        yield failovers
        switches = CounterMetricFamily("pdserve_controller_role_switches", "Role switch commands sent")
        switches.add_metric([], c.num_role_switches + (cluster.num_role_switches if cluster else 0))
        yield switches
        fb = GaugeMetricFamily("pdserve_controller_fallback_mode", "1 while the cluster runs hybrid fallback")
        fb.add_metric([], float(bool(cluster and cluster.mode.mode == "FALLBACK")))
        yield fb
        leader = GaugeMetricFamily("pdserve_controller_leader", "1 on the elected leader")
        leader.add_metric([], float(c.is_leader))
        yield leader
        store = GaugeMetricFamily("pdserve_controller_store_ok", "1 while the state store answers")
        store.add_metric([], float(c.election.is_store_ok and c.persister.is_store_ok))
        yield store
        writes = CounterMetricFamily("pdserve_controller_store_writes",
                                     "Cluster state writes (puts and deletes) the store took")
        writes.add_metric([], c.persister.num_writes)
        yield writes
        for name, doc, value in (
                ("heartbeats", "Agent heartbeats handled as leader", c.num_heartbeats),
                ("instance_reports", "Instance reports in those heartbeats", c.num_instance_reports),
                ("heartbeat_cpu_seconds", "CPU seconds spent handling them", c.heartbeat_cpu_s),
                ("stalled_seconds", "Seconds the leader's loop ran late (not counted as agents' silence)",
                 c.stalled_s)):
            family = CounterMetricFamily(f"pdserve_controller_{name}", doc)
            family.add_metric([], value)
            yield family
        view = cluster.planner_view() if cluster else None
        if view is not None:
            yield from planner_metrics(view)


def planner_metrics(p):
    """``pdserve_controller_planner_*``: the SLO planner's last decision (leader only)."""
    engines = GaugeMetricFamily("pdserve_controller_planner_engines",
                                "Engines by role: wanted for the SLO, asked for (pool sizes the actuators run)",
                                labels=["role", "kind"])
    for role in ("prefill", "decode"):
        engines.add_metric([role, "wanted"], getattr(p, f"wanted_{role}"))
        engines.add_metric([role, "asked"], getattr(p, f"replicas_{role}"))
    yield engines
    actions = CounterMetricFamily("pdserve_controller_planner_actions", "Planner actions taken (switches and scales)")
    actions.add_metric([], p.num_actions)
    yield actions
    for name, doc, value in (
            ("request_rate", "Prompts prefilled per second over the planner's window", p.request_rate),
            ("measured_ttft_seconds", "Queue + prefill + exposed KV transfer per request, over the window",
             p.measured_ttft_s),
            ("measured_tpot_seconds", "Decode step time at the measured batch, over the window", p.measured_tpot_s),
            ("ttft_target_seconds", "The TTFT target the planner plans for", p.ttft_target_s),
            ("tpot_target_seconds", "The TPOT target the planner plans for", p.tpot_target_s),
            ("prefill_tokens_per_second", "One prefill engine's speed as learnt", p.prefill_tokens_per_s),
            ("advisory", "1 when the planner only reports", float(p.advisory))):
        gauge = GaugeMetricFamily(f"pdserve_controller_planner_{name}", doc)
        gauge.add_metric([], value)
        yield gauge


def create_http_app(controller: Controller) -> web.Application:
    """/metrics, /healthz (process alive), /readyz (serving: leader or standby), /leaderz."""

    def leaderz() -> tuple[bool, str]:
        if controller.is_leader:
            return True, "leader\n"
        return False, f"standby; leader is {controller.election.leader}\n"

    return create_side_app(registry_of(ControllerCollector(controller)),
                           {"/healthz": alive, "/readyz": alive, "/leaderz": leaderz})


__all__ = ["ControllerServicer", "create_grpc_server", "create_http_app", "pb"]
