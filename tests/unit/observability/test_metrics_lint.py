"""Every component's metrics, rendered in-process, pass ``promtool check metrics`` and
follow ``pdserve_<component>_<what>_<unit>`` (the integration test checks the same on
running processes)."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
from types import SimpleNamespace

from pdserve.api.proto.engine_pb2 import StatsResponse
from pdserve.coordinator.metrics import CoordinatorMetrics
from pdserve.engine.metrics import EngineMetrics

PROMTOOL = shutil.which("promtool")
NAME = re.compile(r"^# TYPE (pdserve_(\w+?)_\w+) (counter|gauge|histogram|summary|info)$", re.M)


def promtool(text: str) -> str:
    out = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=30)
    return (out.stdout + out.stderr).strip()


def check(text: str, component: str) -> None:
    names = NAME.findall(text)
    assert names, "no metrics"
    assert {c for _, c, _ in names} == {component}
    assert PROMTOOL, "promtool is not installed: `make test` installs the Debian package prometheus"
    assert promtool(text) == ""


def engine_stats(role: str = "prefill") -> StatsResponse:
    return StatsResponse(
        num_running=2, num_waiting=1, num_kv_blocks_total=100, num_kv_blocks_used=30,
        num_kv_blocks_free=70, kv_cache_bytes=1 << 20, block_size=16,
        prefix_cache_query_tokens=64, prefix_cache_hit_tokens=16, num_preemptions=0,
        num_prompt_tokens_total=64, num_generation_tokens_total=1, role=role, model="tiny",
        kv_transport="tcp", num_kv_transfers_active=1)


def transfer(role: str, mode: str = "layerwise", num_bytes: int = 4096, done_s: float | None = None):
    import time

    now = time.monotonic()
    return SimpleNamespace(params=SimpleNamespace(role=role, mode=mode), started_s=now - 0.01, is_full=False, is_cancelled=False,
                           prefill_done_s=done_s if done_s is not None else now - 0.002,
                           handles=[SimpleNamespace(num_bytes=num_bytes)])


def test_engine_metrics_count_transfers_by_mode_transport_and_role():
    m = EngineMetrics("tcp")
    m.observe_transfer(transfer("prefill"), ok=True)
    m.observe_transfer(transfer("decode", mode="pull"), ok=True)
    m.observe_transfer(transfer("prefill"), ok=False)
    text = m.render(engine_stats()).decode()
    check(text, "engine")
    assert 'pdserve_engine_kv_transfer_bytes_total{mode="layerwise",role="prefill",transport="tcp"} 4096.0' in text
    assert 'pdserve_engine_kv_transfer_failures_total{mode="layerwise",role="prefill",transport="tcp"} 1.0' in text
    assert 'pdserve_engine_kv_transfer_exposed_seconds_count{mode="layerwise",transport="tcp"} 1.0' in text
    assert 'pdserve_engine_kv_transfer_duration_seconds_count{mode="pull",role="decode",transport="tcp"} 1.0' in text
    assert 'pdserve_engine_running_requests{role="prefill"} 2.0' in text
    assert 'pdserve_engine_prefix_cache_hit_ratio{role="prefill"} 0.25' in text
    assert "request_id" not in text and "transfer_id" not in text


def test_engine_without_kv_transport_renders_load_only():
    text = EngineMetrics("none").render(engine_stats("hybrid")).decode()
    check(text, "engine")
    assert "kv_transfer_bytes_total{" not in text


def test_coordinator_metrics():
    m = CoordinatorMetrics()
    m.requests.labels("completions", "200").inc()
    m.ttft.observe(0.05)
    m.observe_stage("kv_transfer", 0.002)
    text = m.render().decode()
    check(text, "coordinator")
    # Counters with bounded label sets exist at zero before their first event.
    assert 'pdserve_coordinator_rejected_total{reason="queue_full"} 0.0' in text
    assert 'pdserve_coordinator_retries_total{leg="decode",stage="mid_stream"} 0.0' in text


def _render(collector) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_controller_metrics():
    """A real leader on an in-memory store: one heartbeat of two instances is counted,
    with the CPU it took and the state writes it caused."""
    import asyncio

    from pdserve.api.proto import controller_pb2 as pb
    from pdserve.controller.core import Controller, ControllerSettings
    from pdserve.controller.service import ControllerCollector
    from pdserve.controller.store import MemoryStore
    from tests.unit.controller.test_cluster import report
    from tests.unit.controller.test_commit import eventually

    async def go() -> str:
        controller = Controller(ControllerSettings(cluster_name="c"), MemoryStore())
        await controller.start()
        await eventually(lambda: controller.is_leader)
        await controller.heartbeat(pb.HeartbeatRequest(agent_id="a", instances=[
            report("p0", "prefill"), report("d0", "decode")]))
        await eventually(lambda: controller.persister.num_writes >= 3)  # two records, the meta
        text = _render(ControllerCollector(controller))
        await controller.stop()
        return text

    text = asyncio.run(go())
    check(text, "controller")
    for name in ("instances", "failovers_total", "role_switches_total", "fallback_mode", "leader"):
        assert f"pdserve_controller_{name}" in text
    value = {m[0]: float(m[1]) for m in re.findall(r"^(pdserve_controller_\w+) (\S+)$", text, re.M)}
    assert value["pdserve_controller_heartbeats_total"] == 1
    assert value["pdserve_controller_instance_reports_total"] == 2
    assert value["pdserve_controller_heartbeat_cpu_seconds_total"] > 0
    assert value["pdserve_controller_stalled_seconds_total"] >= 0
    assert value["pdserve_controller_store_writes_total"] >= 3


def test_nodeagent_metrics():
    from pdserve.nodeagent.agent import HeartbeatStats
    from pdserve.nodeagent.http import AgentCollector

    inst = SimpleNamespace(instance_id="p0", role="prefill", is_ready=True,
                           process=SimpleNamespace(num_restarts=2))
    stats = HeartbeatStats(num_ok=4, seconds_total=0.2, num_exit_reports=1, exit_report_seconds_total=0.3,
                           exit_report_seconds_max=0.3)
    text = _render(AgentCollector(SimpleNamespace(instances={"p0": inst}, num_heartbeats_failed=0, stats=stats)))
    check(text, "nodeagent")
    assert "pdserve_nodeagent_engine_restarts_total" in text


def test_operator_metrics():
    module = importlib.import_module("pdserve.operator.metrics")
    from prometheus_client import generate_latest

    metrics = module.OperatorMetrics()
    metrics.count("create")
    metrics.count("update", "api")
    check(generate_latest(metrics.registry).decode(), "operator")
