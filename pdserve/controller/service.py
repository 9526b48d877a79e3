"""The Controller's gRPC service and HTTP endpoints (metrics, probes).

Owns the translation between the network and ``Controller``: a standby answers
FAILED_PRECONDITION naming the leader (agents and Coordinators then try the next
address), every call passes the cluster-token interceptor (and mTLS when
configured). ``create_grpc_server`` and ``create_http_app`` are factories; the CLI
wires them.
"""

from __future__ import annotations

import json

import grpc
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.api.security import SecuritySettings, add_port, server_interceptors
from pdserve.controller.core import Controller, NotLeader
from pdserve.controller.health import DRAINING, FAILED, READY, STARTING, SUSPECT
from pdserve.controller.persist import StatePersister


class ForgottenPersister(StatePersister):
    """Installed by ``ForgetCluster``: the deleted cluster's state is never written again."""

    async def flush(self, cluster, now_s: float) -> None:
        return None


class ControllerServicer(pb_grpc.ControllerServicer):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        # instance id -> heartbeat time when its drain command was seen delivered
        # (None: queued, not yet delivered). Per process: a new leader re-sends.
        self._drains: dict[str, float | None] = {}

    async def Heartbeat(self, request, context):
        try:
            return await self.controller.heartbeat(request)
        except NotLeader as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    async def GetView(self, request, context):
        try:
            return self.controller.view()
        except NotLeader as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    async def WatchView(self, request, context):
        try:
            async for view in self.controller.watch():
                yield view
        except NotLeader as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    async def Drain(self, request, context):
        """Called by the operator before it deletes a scaled-down instance."""
        try:
            cluster = self.controller._require_leader()
        except NotLeader as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        rec = cluster.records.get(request.instance_id)
        if rec is None:
            return pb.DrainResponse(is_known=False, is_drained=True)
        if request.instance_id not in self._drains:
            cluster._command(rec, "drain", deadline_s=request.deadline_s)
            self._drains[request.instance_id] = None
            cluster._event(f"{rec.instance_id}: drain requested by the operator")
        pending = cluster._pending.get(rec.agent_id, [])
        is_delivered = not any(c.instance_id == rec.instance_id and c.kind == "drain" for c in pending)
        if is_delivered and self._drains[request.instance_id] is None:
            self._drains[request.instance_id] = rec.last_heartbeat_s
        delivered_at = self._drains[request.instance_id]
        num_running, num_waiting = rec.load.get("num_running", 0), rec.load.get("num_waiting", 0)
        is_idle = (delivered_at is not None and rec.last_heartbeat_s > delivered_at
                   and num_running == 0 and num_waiting == 0)
        return pb.DrainResponse(is_known=True, is_drained=is_idle or rec.health == FAILED,
                                num_running=num_running, num_waiting=num_waiting, health=rec.health)

    async def ListReplacements(self, request, context):
        """Called by the operator on every reconcile."""
        try:
            self.controller._require_leader()
        except NotLeader as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        persister = self.controller.persister
        out = pb.ListReplacementsResponse()
        for key, text in (await self.controller.store.get_prefix(persister.key("replace", ""))).items():
            data = json.loads(text)
            out.replacements.add(instance_id=data.get("instance", key.rsplit("/", 1)[-1]),
                                 reason=data.get("reason", ""),
                                 requested_unix_s=data.get("requested_unix_s", 0.0))
        return out

    async def AckReplacement(self, request, context):
        """Called by the operator once it deleted the instance's Pod for recreation."""
        try:
            cluster = self.controller._require_leader()
        except NotLeader as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        await self.controller.store.delete(self.controller.persister.key("replace", request.instance_id))
        rec = cluster.records.get(request.instance_id)
        if rec is not None:  # the new Pod starts with a clean failure history
            rec.replacement_requested, rec.failures = False, []
            cluster.dirty.add(rec.instance_id)
        return pb.AckReplacementResponse()

    async def ForgetCluster(self, request, context):
        """Called by the operator's delete handler after every engine Pod is gone."""
        try:
            cluster = self.controller._require_leader()
        except NotLeader as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        c = self.controller
        old = c.persister
        c.persister = ForgottenPersister(c.store, old.prefix, old.lease_ttl_s)
        cluster.records.clear()
        cluster.dirty.clear()
        cluster.removed.clear()
        cluster.replacements.clear()
        cluster.meta_dirty = False
        leader_key = old.key("leader")
        keys = [k for k in await c.store.get_prefix(old.prefix + "/") if k != leader_key]
        for key in keys:
            await c.store.delete(key)
        return pb.ForgetClusterResponse(num_keys_deleted=len(keys))


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


def create_http_app(controller: Controller) -> web.Application:
    """/metrics, /healthz (process alive), /readyz (serving: leader or standby), /leaderz."""
    registry = CollectorRegistry()
    registry.register(ControllerCollector(controller))

    async def metrics(_):
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    async def healthz(_):
        return web.Response(text="ok\n")

    async def leaderz(_):
        if controller.is_leader:
            return web.Response(text="leader\n")
        return web.Response(status=503, text=f"standby; leader is {controller.election.leader}\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", healthz)
    app.router.add_get("/leaderz", leaderz)
    return app


__all__ = ["ControllerServicer", "create_grpc_server", "create_http_app", "pb"]
