"""The NodeAgent's HTTP endpoints for the kubelet and Prometheus (``create_http_app``).

``/healthz``: the agent's loop runs (200). ``/readyz``: every engine answers its
probe and has its KV transport registered (Health.kv_endpoint set), else 503
with the instances that are not. ``/metrics``: ``pdserve_nodeagent_*``, read from
the agent at scrape time.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.nodeagent.agent import Agent


class AgentCollector:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self):
        restarts = CounterMetricFamily("pdserve_nodeagent_engine_restarts",
                                       "Engine relaunches after an exit or a restart command",
                                       labels=["instance_id"])
        up = GaugeMetricFamily("pdserve_nodeagent_engine_ready",
                               "1 while the engine answers probes with its KV transport registered",
                               labels=["instance_id", "role"])
        for inst in self.agent.instances.values():
            restarts.add_metric([inst.instance_id], inst.process.num_restarts)
            up.add_metric([inst.instance_id, inst.role], float(inst.is_ready))
        yield restarts
        yield up
        failed = CounterMetricFamily("pdserve_nodeagent_heartbeats_failed",
                                     "Heartbeats the Controller did not accept")
        failed.add_metric([], self.agent.num_heartbeats_failed)
        yield failed


def create_http_app(agent: Agent) -> web.Application:
    registry = CollectorRegistry()
    registry.register(AgentCollector(agent))

    async def metrics(_):
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    async def healthz(_):
        return web.Response(text="ok\n")

    async def readyz(_):
        not_ready = [i.instance_id for i in agent.instances.values() if not i.is_ready]
        if not_ready:
            return web.Response(status=503, text="not ready: " + ", ".join(not_ready) + "\n")
        return web.Response(text="ready\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app
