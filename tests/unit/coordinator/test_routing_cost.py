"""What a request and a view cost the router: the state a request reads is kept between
requests, and a view of new load figures (the Controller's every second) keeps it."""

from __future__ import annotations

import asyncio
import random
import time

from pdserve.coordinator.instances import EngineEndpoint, InstanceRegistry
from pdserve.coordinator.metrics import CoordinatorMetrics
from pdserve.coordinator.pairs import PairChecks, PairResult
from pdserve.coordinator.policies import RouteContext
from pdserve.coordinator.policies.base import least_queue
from pdserve.coordinator.policies.least_loaded import LeastLoaded
from pdserve.coordinator.policies.prefix_cache_aware import PrefixCacheAware
from pdserve.coordinator.prefix_index import PrefixIndex
from pdserve.coordinator.router import Router
from pdserve.coordinator.settings import CoordinatorSettings
from pdserve.runtime.block_hash import hash_chain
from tests.unit.coordinator.harness import ALWAYS_PD, inst


def view(load: int = 0, **changes) -> list:
    """p1, p2, d1, d2 with ``load`` running on each; ``changes``: id -> fields."""
    return [inst(i, "prefill" if i[0] == "p" else "decode", num_running=load, **changes.get(i, {}))
            for i in ("p1", "p2", "d1", "d2")]


def probed(registry: InstanceRegistry) -> tuple[PairChecks, list]:
    """Pair checks whose probes all pass, and the pairs each round probed."""
    pairs = PairChecks(registry)
    asked = []

    async def ask(p, d):
        asked.append((p.instance_id, d.instance_id))
        return True, "", 0.0

    pairs._ask = ask
    return pairs, asked


def checked_router() -> tuple[InstanceRegistry, Router]:
    """A registry with ``view()``, its pairs checked once, and a router over both."""
    registry = InstanceRegistry()
    registry.replace(view())
    pairs, _ = probed(registry)
    asyncio.run(pairs.check_once())
    return registry, Router(CoordinatorSettings(**ALWAYS_PD), registry, PrefixIndex(100),
                            CoordinatorMetrics(), pairs)


def test_pools_are_kept_until_a_view_changes_members_or_an_engine_is_marked():
    registry = InstanceRegistry()
    registry.replace(view())
    pools = registry.pools()
    assert registry.pools() is pools
    registry.replace(view(load=7))  # new load figures only
    assert registry.pools() is pools
    registry.replace(view(load=7, d2={"draining": True}))
    assert [d.instance_id for d in registry.pools().decode] == ["d1"]
    registry.replace(view())
    registry.mark_full("d1", 0.05)
    assert [d.instance_id for d in registry.pools().decode] == ["d2"]
    time.sleep(0.06)  # the mark ran out: d1 is back without a view
    assert [d.instance_id for d in registry.pools().decode] == ["d1", "d2"]
    registry.mark_failed("p1")
    assert [p.instance_id for p in registry.pools().prefill] == ["p2"]
    assert [p.instance_id for p in registry.pools({"p2"}).prefill] == ["p1", "p2"]  # a retry: afresh


def test_the_pairing_is_kept_through_a_view_of_new_load_figures():
    registry, router = checked_router()
    pairing = router.pairing(registry.pools())
    registry.replace(view(load=3))
    assert router.pairing(registry.pools()) is pairing
    registry.replace([*view(load=3)[:3], inst("d2", "decode", "other")])  # d2: another model
    assert router.pairing(registry.pools()).decode == [registry.get("d1")]


def test_partners_of_a_whole_pool_are_that_pool():
    registry = InstanceRegistry()
    registry.replace(view())
    router = Router(CoordinatorSettings(**ALWAYS_PD), registry, PrefixIndex(100), CoordinatorMetrics())
    pools = registry.pools()
    pairing = router.pairing(pools)
    assert pairing.prefill is pools.prefill and pairing.decode is pools.decode
    assert all(pairing.partners[d.instance_id] is pools.prefill for d in pools.decode)
    assert all(pairing.partners[p.instance_id] is pools.decode for p in pools.prefill)


def test_a_pair_check_round_looks_at_the_pairs_only_when_one_may_be_due():
    registry = InstanceRegistry()
    registry.replace(view())
    pairs, asked = probed(registry)
    looks = []
    all_instances = registry.all
    registry.all = lambda: looks.append(1) or all_instances()
    asyncio.run(pairs.check_once())
    assert len(asked) == 4 and looks
    looks.clear()
    registry.replace(view(load=5))  # new load figures: nothing due, nothing read
    asyncio.run(pairs.check_once())
    assert looks == [] and len(asked) == 4
    registry.replace([*view(load=5), inst("d3", "decode")])  # a new engine: its pairs probed
    asyncio.run(pairs.check_once())
    assert sorted(asked[4:]) == [("p1", "d3"), ("p2", "d3")]
    pairs.recheck("d1")  # a leg on d1 failed: its pairs again
    asyncio.run(pairs.check_once())
    assert sorted(asked[6:]) == [("p1", "d1"), ("p2", "d1")]


def loaded_view(rng: random.Random, n: int = 40) -> list:
    """``n`` decode engines in shuffled order, with few distinct loads (ties)."""
    ids = [f"d{k:02d}" for k in range(n)]
    rng.shuffle(ids)
    return [inst(i, "decode", num_running=rng.randrange(3), num_waiting=rng.randrange(2),
                 num_kv_blocks_used=rng.choice((0, 8)), num_kv_blocks_free=8) for i in ids]


def test_a_pools_load_order_answers_as_a_scan_while_loads_change():
    """The least loaded engine of a registry's pool, from its kept order, is the one a scan
    of the pool finds (ties rotating the same way), through legs starting and ending,
    fields written in place and views of new load figures."""
    rng = random.Random(7)
    registry = InstanceRegistry()
    registry.replace(loaded_view(rng))
    pool = registry.pools().decode
    assert [d.instance_id for d in pool] == sorted(d.instance_id for d in pool)
    for step in range(400):
        engine = rng.choice(pool)
        if step % 50 == 49:
            registry.replace(loaded_view(rng))
        elif step % 3:
            engine.num_inflight += 1
        else:
            engine.num_inflight = max(0, engine.num_inflight - 2)
        start = rng.randrange(100)
        assert least_queue(pool, start) is least_queue(list(pool), start)


def test_choosing_from_a_pool_does_not_read_every_engines_load(monkeypatch):
    registry = InstanceRegistry()
    registry.replace(loaded_view(random.Random(3), 64))
    pool = registry.pools().decode
    policy = LeastLoaded()
    policy.choose(pool, RouteContext([1], 8))  # builds the order
    reads = []
    depth = EngineEndpoint.queue_depth
    monkeypatch.setattr(EngineEndpoint, "queue_depth", property(lambda e: reads.append(e) or depth.fget(e)))
    for _ in range(10):
        policy.choose(pool, RouteContext([1], 8)).num_inflight += 1  # a leg starts there
    assert len(reads) <= 10  # the engines whose load changed, not the pool's 64


def test_the_prefix_index_finds_the_longest_holders_as_match_would():
    rng = random.Random(5)
    index = PrefixIndex(max_blocks=24)
    chains = [hash_chain([rng.randrange(50) for _ in range(64)], 8) for _ in range(6)]
    ids = [f"e{k}" for k in range(8)]
    for step in range(300):
        e, chain = rng.choice(ids), rng.choice(chains)
        if e == "e7":  # an engine publishing its events, with evictions and snapshots
            index.apply(e, step % 40 == 0, chain[: rng.randrange(1, 9)], rng.sample(chain, 2))
        elif step % 97 == 0:
            index.forget(e)
        else:
            index.record(e, chain[: rng.randrange(1, 9)])
        among = set(rng.sample(ids, 5))
        query = rng.choice(chains)
        matches = {i: index.match(i, query) for i in among}
        best, holders = index.longest(query, among)
        assert best == max(matches.values())
        assert holders == ({i for i, m in matches.items() if m == best} if best else set())


def test_prefix_cache_aware_picks_the_same_from_a_pool_as_from_a_list():
    rng = random.Random(9)
    registry = InstanceRegistry()
    registry.replace([inst(f"p{k}", "prefill", num_running=rng.randrange(4)) for k in range(12)])
    pool = registry.pools().prefill
    index = PrefixIndex(1000)
    prompts = [[rng.randrange(40) for _ in range(64)] for _ in range(5)]
    for p in pool:
        index.record(p.instance_id, hash_chain(rng.choice(prompts)[: rng.randrange(8, 64)], 8))
    on_pool, on_list = PrefixCacheAware(index), PrefixCacheAware(index)
    for _ in range(60):
        ctx = RouteContext(rng.choice(prompts), 8)
        chosen = on_pool.choose(pool, ctx)
        assert on_list.choose(list(reversed(pool)), ctx) is chosen
        chosen.num_inflight += 1


def test_max_model_len_is_worked_out_once_per_view():
    registry = InstanceRegistry()
    registry.replace([inst("d1", "decode", max_model_len=64), inst("d2", "decode", max_model_len=32)])
    assert registry.max_model_len() == 32
    registry._instances = CountingDict(registry._instances)
    for _ in range(5):
        assert registry.max_model_len() == 32
    assert registry._instances.reads == 0
    registry.replace([inst("d1", "decode", max_model_len=64)])
    assert registry.max_model_len() == 64


class CountingDict(dict):
    reads = 0

    def values(self):
        self.reads += 1
        return super().values()


def test_an_engine_marked_full_changes_the_pairing_without_probing_every_pair_again():
    """The pools change (d1 full: the others first) but not the members or the probes:
    the pairing follows without asking ``can_pair`` of every P x D again."""
    registry, router = checked_router()
    router.pairing(registry.pools())
    asked = []
    can_pair = router.can_pair
    router.can_pair = lambda p, d: asked.append((p, d)) or can_pair(p, d)
    registry.mark_full("d1", 60)
    pools = registry.pools()
    pairing = router.pairing(pools)
    assert [d.instance_id for d in pairing.decode] == ["d2"] and pairing.partners["d2"] is pools.prefill
    assert asked == []


def test_a_pair_result_holds_no_dict():
    """One result per P x D pair (187,500 at 250 x 750 engines): slots, not a dict each."""
    assert not hasattr(PairResult(True, "", "d1:2", 0.0), "__dict__")
