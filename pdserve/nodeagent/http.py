"""The NodeAgent's HTTP endpoints for the kubelet and Prometheus (``create_http_app``).

``/healthz``: the agent's loop runs (200). ``/readyz``: every engine answers its
probe and has its KV transport registered (Health.kv_endpoint set), else 503
with the instances that are not (and the last exit of those that died).
``/metrics``: ``pdserve_nodeagent_*``, read from the agent at scrape time.
``/status``: JSON, one entry per engine: process state, restarts, readiness, the
last exit (code, the error line, the lines around it) and ``failing_to_start``
(see ``process.EngineProcess``); ``pdserve up`` polls it to stop on an engine
that cannot start and show why.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.nodeagent.agent import Agent
from pdserve.runtime.http import alive, create_side_app, registry_of


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
        stats = self.agent.stats
        for name, doc, value in (
                ("heartbeats", "Heartbeats the Controller accepted", stats.num_ok),
                ("heartbeat_seconds", "Seconds from building a heartbeat to its accepted reply, summed",
                 stats.seconds_total),
                ("exit_reports", "Engine exits reported (each counted once, by the heartbeat that carried it)",
                 stats.num_exit_reports),
                ("exit_report_seconds", "Seconds from seeing an engine exit to the Controller accepting "
                                        "its report, summed", stats.exit_report_seconds_total)):
            family = CounterMetricFamily(f"pdserve_nodeagent_{name}", doc)
            family.add_metric([], value)
            yield family
        worst = GaugeMetricFamily("pdserve_nodeagent_exit_report_max_seconds",
                                  "The longest an engine exit's report took to be accepted, since start")
        worst.add_metric([], stats.exit_report_seconds_max)
        yield worst


def engine_status(agent: Agent) -> dict:
    """The ``/status`` document; read on the event loop, no I/O."""
    engines = []
    for inst in agent.instances.values():
        p = inst.process
        engines.append({
            "instance_id": inst.instance_id, "pool": inst.pool, "role": inst.role,
            "state": p.state, "pid": p.pid, "is_ready": inst.is_ready, "num_restarts": p.num_restarts,
            "last_exit": p.last_exit, "last_exit_code": p.last_exit_code, "error_lines": p.error_lines,
            "failing_to_start": p.is_failing_to_start})
    return {"agent_id": agent.settings.agent_id, "engines": engines}


def create_http_app(agent: Agent) -> web.Application:
    def readyz() -> tuple[bool, str]:
        not_ready = [i for i in agent.instances.values() if not i.is_ready]
        if not_ready:
            return False, "not ready: " + ", ".join(
                i.instance_id + (f" ({i.process.last_exit})" if i.process.last_exit else "")
                for i in not_ready) + "\n"
        return True, "ready\n"

    async def status(_):
        return web.json_response(engine_status(agent))

    app = create_side_app(registry_of(AgentCollector(agent)), {"/healthz": alive, "/readyz": readyz})
    app.router.add_get("/status", status)
    return app
