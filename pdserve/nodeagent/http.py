"""The NodeAgent's HTTP endpoints for the kubelet and Prometheus (``create_http_app``).

``/healthz``: the agent's loop runs (200). ``/readyz``: every engine answers its
probe and has its KV transport registered (Health.kv_endpoint set), else 503
with the instances that are not. ``/metrics``: ``pdserve_nodeagent_*``, read from
the agent at scrape time.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.api.http_runtime import alive, create_side_app, registry_of
from pdserve.nodeagent.agent import Agent


class AgentCollector:
    """``pdserve_nodeagent_*`` metrics, read from the agent at scrape time."""

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
    def readyz() -> tuple[bool, str]:
        not_ready = [i.instance_id for i in agent.instances.values() if not i.is_ready]
        if not_ready:
            return False, "not ready: " + ", ".join(not_ready) + "\n"
        return True, "ready\n"

    return create_side_app(registry_of(AgentCollector(agent)),
                           {"/healthz": alive, "/readyz": readyz})
