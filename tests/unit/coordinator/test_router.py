"""The router: PD pairing, compat hashes, conditional disaggregation, fallback policies."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from pdserve.coordinator.errors import ServeError
from pdserve.coordinator.instances import InstanceRegistry
from pdserve.coordinator.metrics import CoordinatorMetrics
from pdserve.coordinator.pairs import PairChecks
from pdserve.coordinator.policies import RouteContext
from pdserve.coordinator.prefix_index import PrefixIndex
from pdserve.coordinator.router import Router
from pdserve.coordinator.settings import CoordinatorSettings
from tests.unit.coordinator.harness import ALWAYS_PD, inst


def make_router(instances, **overrides):
    settings = CoordinatorSettings(block_size=8, prefill_policy="round_robin",
                                   decode_policy="round_robin", **{**ALWAYS_PD, **overrides})
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
    registry.replace([inst("p1", "prefill"), inst("p2", "prefill", draining=True),
                      inst("d1", "decode")])  # a view drains p2
    assert plan(router).prefill.instance_id == "p1"


def test_with_a_controller_a_retry_waits_for_the_view_before_an_engine_that_failed_it():
    """The only decode engine failed the request: with a Controller, the retry waits for
    the view to change (it falls back to hybrid) rather than calling the dead engine
    again; with nothing changing it does, once ``suspect_s`` has passed."""
    router, registry, _ = make_router([inst("p1", "prefill"), inst("d1", "decode")],
                                      controller="c:1", suspect_s=0.3)

    async def fallback():
        task = asyncio.ensure_future(router.plan(RouteContext(list(range(32)), 8), {"d1"},
                                                 time.monotonic() + 5))
        await asyncio.sleep(0.1)
        assert not task.done()
        registry.replace([inst("p1", "hybrid")], mode="FALLBACK")  # d1 gone, p1 hybrid
        return await asyncio.wait_for(task, 1)

    p = asyncio.run(fallback())
    assert (p.kind, p.single.instance_id) == ("single", "p1")
    registry.replace([inst("p1", "prefill"), inst("d1", "decode")])
    t0 = time.monotonic()
    p = plan(router, exclude={"d1"})
    assert (p.kind, p.decode.instance_id) == ("pd", "d1") and 0.25 < time.monotonic() - t0 < 1.0
    router, _, _ = make_router([inst("p1", "prefill"), inst("d1", "decode")], suspect_s=5)
    t0 = time.monotonic()
    assert plan(router, exclude={"d1"}).decode.instance_id == "d1"  # static: no one to wait for
    assert time.monotonic() - t0 < 0.2


def decisions(metrics, where, reason) -> float:
    return metrics.registry.get_sample_value(
        "pdserve_coordinator_prefill_decisions_total", {"where": where, "reason": reason}) or 0.0


def test_conditional_disaggregation_is_on_by_default():
    settings = CoordinatorSettings()
    assert settings.local_prefill_max_tokens > 0 and settings.load_aware_local_prefill
    router, _, metrics = make_router([inst("p1", "prefill"), inst("d1", "decode")],
                                     local_prefill_max_tokens=settings.local_prefill_max_tokens,
                                     load_aware_local_prefill=True)
    assert plan(router, range(32)).kind == "single"
    assert plan(router, range(200, 500)).kind == "pd"
    assert decisions(metrics, "decode", "short_prompt") == 1
    assert decisions(metrics, "prefill", "long_prompt") == 1


def test_a_backed_up_prefill_engine_sends_the_prompt_to_decode_unless_it_would_stall_streams():
    rates = {"prefill_tokens_per_s": 1000.0}
    p = inst("p1", "prefill", num_pending_prefill_tokens=4000, **rates)  # 4 s of work queued
    d = inst("d1", "decode", **rates)
    router, _, metrics = make_router([p, d], local_prefill_max_tokens=16,
                                     load_aware_local_prefill=True, tpot_slo_s=0.5)
    # 300 tokens: 0.3 s on an idle D against 4.3 s behind P's queue.
    assert plan(router, range(300)).kind == "single"
    assert decisions(metrics, "decode", "prefill_busy") == 1
    # D now decodes streams: 0.3 s fits the 0.5 s TPOT budget, 800 tokens (0.8 s) does not.
    d.num_running = 4
    assert plan(router, range(1000, 1300)).kind == "single"
    assert plan(router, range(2000, 2800)).kind == "pd"
    assert decisions(metrics, "prefill", "stall_guard") == 1
    # P is idle again: a long prompt goes to P whatever D does.
    p.num_pending_prefill_tokens, d.num_running = 0, 0
    assert plan(router, range(3000, 3800)).kind == "pd"


def test_a_burst_of_short_prompts_is_split_between_decode_and_an_idle_prefill_engine():
    p, d = inst("p1", "prefill"), inst("d1", "decode")
    router, _, metrics = make_router([p, d], local_prefill_max_tokens=64,
                                     load_aware_local_prefill=True)
    kinds = []
    for i in range(8):  # nothing finishes meanwhile: what the lifecycle would count
        chosen = plan(router, range(100 * i, 100 * i + 32))
        kinds.append(chosen.kind)
        (d if chosen.kind == "single" else p).num_pending_prefill_tokens += 32
    assert kinds[0] == "single" and 3 <= kinds.count("single") <= 5, kinds
    assert decisions(metrics, "prefill", "decode_busy") == kinds.count("pd")
    # While P works through a long prompt, short prompts all stay on D.
    p.num_pending_prefill_tokens, d.num_pending_prefill_tokens = 1800, 0
    assert all(plan(router, range(5000 + 50 * i, 5032 + 50 * i)).kind == "single"
               for i in range(4))


def test_load_aware_prefill_can_be_turned_off():
    rates = {"prefill_tokens_per_s": 1000.0}
    p = inst("p1", "prefill", num_pending_prefill_tokens=4000, **rates)
    router, _, _ = make_router([p, inst("d1", "decode", **rates)], local_prefill_max_tokens=16)
    assert plan(router, range(300)).kind == "pd"  # ALWAYS_PD's load_aware_local_prefill=False


@pytest.mark.parametrize("policy", ["hybrid", "queue", "fail"])
def test_a_colocated_deployment_serves_on_hybrid_engines_and_counts_no_fallback(policy):
    router, registry, metrics = make_router([inst("h1", "hybrid"), inst("h2", "hybrid")],
                                            fallback_policy=policy)
    registry.replace(registry.all(), mode="COLOCATED")
    chosen = {plan(router, range(i, i + 8)).single.instance_id for i in range(4)}
    assert chosen == {"h1", "h2"}
    samples = metrics.registry.get_sample_value
    assert not any(samples("pdserve_coordinator_fallbacks_total", {"policy": policy, "reason": r})
                   for r in ("no_prefill_or_decode_engine", "no_prefill_engine", "no_decode_engine"))


def test_the_kept_pairing_follows_the_view_the_pools_and_the_probes():
    """``compatible`` is worked out once per set of pools and kept; each input of
    ``can_pair`` changing gives a fresh answer, never the kept one."""
    registry = InstanceRegistry()
    registry.replace([inst("p1", "prefill"), inst("d1", "decode"), inst("d2", "decode")])
    pairs = PairChecks(registry)
    verdicts = {"d1:2": True, "d2:2": True}

    async def ask(p, d):
        return verdicts[d.kv_endpoint], "" if verdicts[d.kv_endpoint] else "unreachable", 0.0

    pairs._ask = ask
    router = Router(CoordinatorSettings(**ALWAYS_PD), registry, PrefixIndex(1000),
                    CoordinatorMetrics(), pairs)

    def decode_ids():
        prefill, decode, reason = router.compatible(registry.pools())
        return reason or [d.instance_id for d in decode]

    assert decode_ids() == "no_probed_pair"  # nothing probed yet
    asyncio.run(pairs.check_once())
    assert decode_ids() == ["d1", "d2"]
    assert decode_ids() == ["d1", "d2"]  # kept
    verdicts["d2:2"] = False
    pairs.recheck("d2")
    asyncio.run(pairs.check_once())
    assert decode_ids() == ["d1"]  # a probe's verdict changed
    registry.replace([inst("p1", "prefill"), inst("d1", "decode", "other"), inst("d2", "decode")])
    assert decode_ids() == "no_probed_pair"  # the view changed d1's compat hash; d2 failed
    registry.replace([inst("p1", "prefill"), inst("d1", "decode"), inst("d2", "decode")])
    assert decode_ids() == ["d1"]
    registry.replace([inst("p1", "prefill"), inst("d1", "decode", draining=True),
                      inst("d2", "decode")])  # d1 out of the pools: only d2 is left, unusable
    assert decode_ids() == "no_probed_pair"
    registry.replace([inst("p1", "prefill"), inst("d1", "decode"), inst("d2", "decode")])
    registry.mark_failed("d1")  # a suspect is only a last resort: d2 alone in the pool
    assert decode_ids() == "no_probed_pair"
    assert [d.instance_id for d in router.compatible(registry.pools({"d2"}))[1]] == ["d1"]


def test_the_kept_pairing_picks_a_partner_of_the_chosen_engine():
    router, registry, _ = make_router([inst("p1", "prefill", "A"), inst("p2", "prefill", "B"),
                                       inst("d1", "decode", "A"), inst("d2", "decode", "B")])
    for _ in range(4):
        p = plan(router)
        assert p.prefill.kv_compat_hash == p.decode.kv_compat_hash
    assert {plan(router).decode.instance_id for _ in range(4)} == {"d1", "d2"}


def test_which_engines_pair_with_every_other_is_worked_out_from_versions_as_pair_by_pair():
    """``Router._complete`` under published pair checks (or none) reads the peer versions'
    extremes, not every P x D: over random clusters (compat hashes, listed and checked
    versions, published unusable pairs, this Coordinator's failed re-probes, no engine of
    a role) it names exactly the engines ``can_pair`` pairs with every routable one."""
    from pdserve.coordinator.instances import PublishedPairs
    from pdserve.runtime.pair_probes import PairResult

    rng = random.Random(7)
    for trial in range(400):
        engines = [inst(f"{role[0]}{k}", role, rng.choice("aaaab"),
                        peers_listed_version=rng.choice((0, 1, 2, 3, 3)) if role == "decode" else 0,
                        peers_checked_version=rng.choice((0, 1, 2, 3, 3, 3)) if role == "prefill" else 0,
                        healthy=rng.random() > 0.1)
                   for role in ("prefill", "decode") for k in range(rng.randrange(0, 6))]
        prefill = [e.instance_id for e in engines if e.role == "prefill"]
        decode = [e.instance_id for e in engines if e.role == "decode"]
        published = trial % 4 != 0
        unusable = {(p, d): "unreachable" for p in prefill for d in decode if rng.random() < 0.05}
        registry = InstanceRegistry()
        registry.replace(engines, pairs=PublishedPairs(unusable) if published else None)
        checks = PairChecks(registry) if published else None
        for p in prefill:
            for d in decode:
                if checks is not None and rng.random() < 0.05:  # a failed leg's re-probe
                    checks.probes.results[(p, d)] = PairResult(
                        ok=rng.random() < 0.5, reason="refused",
                        kv_endpoint=registry.get(d).kv_endpoint if rng.random() < 0.8 else "old:2",
                        checked_s=time.monotonic())
        router = Router(CoordinatorSettings(), registry, PrefixIndex(100), CoordinatorMetrics(), checks)
        routable = [e for e in registry.all() if e.routable]
        ps = [e for e in routable if e.role == "prefill"]
        ds = [e for e in routable if e.role == "decode"]
        want = ({p.instance_id for p in ps if all(router.can_pair(p, d) for d in ds)}
                | {d.instance_id for d in ds if all(router.can_pair(p, d) for p in ps)})
        assert router._complete() == want, (trial, [(e.instance_id, e.kv_compat_hash,
                                                     e.peers_checked_version, e.peers_listed_version)
                                                    for e in routable], unusable)
