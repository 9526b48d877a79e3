"""The status page's state: each KV transfer counted once (both engines report it) with
its exposed time, what the Coordinator serves and how it routes, and the instances
that do not serve, read from the Controller's events."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pdserve import __version__
from pdserve.coordinator.instances import InstanceRegistry
from pdserve.coordinator.metrics import CoordinatorMetrics
from pdserve.coordinator.settings import CoordinatorSettings
from pdserve.coordinator.ui import StatusBoard
from tests.unit.coordinator.harness import inst


def stats(role: str, num_ok: int = 0, num_bytes: int = 0, exposed_s: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(role=role, kv_transport="tcp", kv_transfers_ok=num_ok, kv_transfers_failed=0,
                           kv_transfer_bytes=num_bytes, kv_exposed_s_total=exposed_s)


def board(**settings) -> StatusBoard:
    deps = SimpleNamespace(settings=CoordinatorSettings(**settings), registry=InstanceRegistry(),
                           metrics=CoordinatorMetrics())
    return StatusBoard(deps)


def test_each_transfer_counts_once_with_the_prefill_sides_exposed_time():
    b = board()
    b._engine_stats = {"p0": stats("prefill"), "d0": stats("decode")}
    b._rates(100.0, b._counters())
    # 10 transfers of 1000 bytes, 0.5 s exposed in all: both sides count each transfer.
    b._engine_stats = {"p0": stats("prefill", 10, 10_000, 0.5), "d0": stats("decode", 10, 10_000)}
    live = b._rates(110.0, b._counters())
    assert live["kv_transfers_per_s"] == 1.0
    assert live["kv_bytes_per_s"] == 1000.0
    assert live["kv_exposed_s"] == 0.05
    assert b._cluster()["kv_transport"] == "tcp"  # as the engines report it


def test_state_names_the_cluster_its_policies_and_the_instances_not_serving():
    b = board(model="/ckpt/qwen", served_model_name="qwen", cluster_name="demo",
              decode_policy="round_robin", fallback_policy="queue", kv_mode="push")
    b._engine_stats = {"p0": stats("prefill"), "d0": stats("decode")}
    b.deps.registry.replace([inst("demo-prefill-0", "prefill")], events=[
        "10:00:00 demo-prefill-0: registered (prefill pool, agent a)",
        "10:00:01 demo-decode-0: registered (decode pool, agent a)",
        "10:00:02 demo-decode-1: registered (decode pool, agent a)",
        "10:00:03 demo-prefill-0: STARTING -> READY (probe ok)",
        "10:00:04 demo-decode-0: STARTING -> FAILED (engine exited with code 2: error: bad model)",
        "10:00:05 demo-decode-1: STARTING -> READY (probe ok)",
        "10:00:06 demo-decode-1: READY -> SUSPECT (3 heartbeats missed)",
    ])
    state, later = asyncio.run(two_states(b, [
        "10:00:07 demo-decode-1: SUSPECT -> READY (heartbeat)",
        "10:00:08 demo-decode-0: forgotten (silent for 20s)"]))
    assert state["cluster"] == {
        "name": "demo", "model": "/ckpt/qwen", "served_model_name": "qwen", "version": __version__,
        "dtype": "float32",  # auto: a checkpoint that names no dtype
        "prefill_policy": "prefix_cache_aware", "decode_policy": "round_robin",
        "fallback_policy": "queue", "kv_mode": "push", "kv_transport": ""}
    assert [r["id"] for r in state["instances"]] == ["demo-prefill-0"]
    assert state["not_serving"] == [
        {"id": "demo-decode-0", "pool": "decode", "state": "failed", "since": "10:00:04",
         "reason": "engine exited with code 2: error: bad model"},
        {"id": "demo-decode-1", "pool": "decode", "state": "suspect", "since": "10:00:06",
         "reason": "3 heartbeats missed"}]
    assert later["not_serving"] == []


async def two_states(b: StatusBoard, later_events: list[str]) -> tuple[dict, dict]:
    """The state now, then after a view whose events window holds only ``later_events``
    (what the earlier events said stays until an event changes it)."""
    registry = b.deps.registry
    try:
        first = await b.state()
        registry.replace(registry.all(), events=later_events)
        b._read_s = 0.0  # read again at once
        return first, await b.state()
    finally:
        await registry.close()
