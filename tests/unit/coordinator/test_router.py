"""The router: PD pairing, compat hashes, conditional disaggregation, fallback policies."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.coordinator.errors import ServeError
from pdserve.coordinator.instances import InstanceRegistry
from pdserve.coordinator.metrics import CoordinatorMetrics
from pdserve.coordinator.policies import RouteContext
from pdserve.coordinator.prefix_index import PrefixIndex
from pdserve.coordinator.router import Router
from pdserve.coordinator.settings import CoordinatorSettings
from tests.unit.coordinator.harness import inst


def make_router(instances, **overrides):
    settings = CoordinatorSettings(block_size=8, prefill_policy="round_robin",
                                   decode_policy="round_robin", **overrides)
    registry = InstanceRegistry()
    registry.replace(instances)
    metrics = CoordinatorMetrics()
    return Router(settings, registry, PrefixIndex(1000), metrics), registry, metrics


def fallbacks(metrics, policy, reason) -> float:
    return metrics.registry.get_sample_value(
        "pdserve_coordinator_fallbacks_total", {"policy": policy, "reason": reason}) or 0.0


def plan(router, tokens=range(32), exclude=(), timeout_s=1.0):
    return asyncio.run(router.plan(RouteContext(list(tokens), 8), set(exclude),
                                   time.monotonic() + timeout_s))


def test_pairs_only_equal_compat_hashes():
    router, _, _ = make_router([inst("p1", "prefill", "A"), inst("d1", "decode", "B"),
                                inst("p2", "prefill", "B")])
    for _ in range(3):
        p = plan(router)
        assert (p.kind, p.prefill.instance_id, p.decode.instance_id) == ("pd", "p2", "d1")


def test_no_compatible_pair_is_a_counted_fallback():
    router, _, metrics = make_router([inst("p1", "prefill", "A"), inst("d1", "decode", "B")],
                                     fallback_policy="fail")
    with pytest.raises(ServeError) as info:
        plan(router)
    assert info.value.status == 503 and "no compatible pair" in info.value.message
    assert fallbacks(metrics, "fail", "no_compatible_pair") == 1


def test_hybrid_fallback_uses_hybrid_engines():
    router, _, metrics = make_router([inst("d1", "decode"), inst("h1", "hybrid")])
    p = plan(router)
    assert (p.kind, p.single.instance_id, p.fallback) == ("single", "h1", "no_prefill_engine")
    assert fallbacks(metrics, "hybrid", "no_prefill_engine") == 1


def test_queue_fallback_waits_for_the_view_then_routes():
    router, registry, metrics = make_router([inst("d1", "decode")], fallback_policy="queue")

    async def go():
        task = asyncio.ensure_future(router.plan(RouteContext(list(range(32)), 8), set(),
                                                 time.monotonic() + 5))
        await asyncio.sleep(0.05)
        assert not task.done()
        registry.replace([inst("d1", "decode"), inst("p1", "prefill")])
        return await asyncio.wait_for(task, 1)

    assert asyncio.run(go()).kind == "pd"
    assert fallbacks(metrics, "queue", "no_prefill_engine") == 1


def test_queue_fallback_ends_at_the_deadline():
    router, _, _ = make_router([inst("p1", "prefill")], fallback_policy="queue")
    t0 = time.monotonic()
    with pytest.raises(ServeError) as info:
        plan(router, timeout_s=0.2)
    assert info.value.status == 503 and 0.15 < time.monotonic() - t0 < 1.0


def test_conditional_disaggregation_runs_short_prompts_on_decode():
    router, _, metrics = make_router([inst("p1", "prefill"), inst("d1", "decode")],
                                     local_prefill_max_tokens=16)
    assert plan(router, range(10)).kind == "single"
    long = plan(router, range(100, 164))
    assert long.kind == "pd"
    # The same long prompt again: D now holds it, the uncached part is short.
    again = plan(router, range(100, 164))
    assert (again.kind, again.single.instance_id) == ("single", "d1")
    assert metrics.local_prefills._value.get() == 2


def test_failed_and_excluded_instances_only_as_last_resort():
    router, registry, _ = make_router([inst("p1", "prefill"), inst("p2", "prefill"),
                                       inst("d1", "decode")])
    registry.mark_failed("p1")
    assert {plan(router).prefill.instance_id for _ in range(4)} == {"p2"}
    assert plan(router, exclude={"p2"}).prefill.instance_id in ("p1", "p2")
    registry.get("p2").draining = True
    assert plan(router).prefill.instance_id == "p1"
