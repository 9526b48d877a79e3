"""Each routing policy on plain data: candidates in, one instance out."""

from __future__ import annotations

import random

from pdserve.coordinator.instances import InstanceRegistry
from pdserve.coordinator.policies import RouteContext
from pdserve.coordinator.policies.least_loaded import LeastLoaded
from pdserve.coordinator.policies.prefix_cache_aware import BALANCE_ABS, PrefixCacheAware
from pdserve.coordinator.policies.round_robin import RoundRobin
from pdserve.coordinator.policies.slo_aware import SLOAware, estimate_ttft_s
from pdserve.coordinator.prefix_index import PrefixIndex
from tests.unit.coordinator.harness import inst

PROMPT = list(range(64))  # 8 blocks of 8


def ctx(tokens=PROMPT) -> RouteContext:
    return RouteContext(list(tokens), block_size=8)


def test_round_robin_cycles_in_id_order():
    rr = RoundRobin()
    pool = [inst("b", "prefill"), inst("a", "prefill"), inst("c", "prefill")]
    assert [rr.choose(pool, ctx()).instance_id for _ in range(6)] == list("abcabc")


def test_least_loaded_prefers_short_queue_then_low_kv_usage():
    policy = LeastLoaded()
    busy = inst("a", "decode", num_running=5)
    idle = inst("b", "decode")
    assert policy.choose([busy, idle], ctx()) is idle
    # Our own in-flight count wins over a stale poll that says "idle".
    idle.num_inflight = 9
    assert policy.choose([busy, idle], ctx()) is busy
    full = inst("c", "decode", num_kv_blocks_used=90, num_kv_blocks_free=10)
    empty = inst("d", "decode", num_kv_blocks_used=10, num_kv_blocks_free=90)
    assert policy.choose([full, empty], ctx()) is empty


def test_a_report_counts_the_others_load_and_our_own_legs_count_as_they_are_now():
    registry = InstanceRegistry()
    a, b = inst("a", "decode"), inst("b", "decode")
    registry.replace([a, b])
    a.num_inflight = 40  # a wave of our streams on a
    registry.replace([inst("a", "decode", num_running=44), inst("b", "decode", num_running=2)])
    assert (a.queue_depth, b.queue_depth) == (44, 2)  # 40 ours + 4 another Coordinator's; 2 others'
    # the wave ends together: until the next report says so, a counts only the others' 4
    # (the report alone would still say 44, and the next wave would all go to b)
    a.num_inflight = 0
    assert a.queue_depth == 4
    policy = LeastLoaded()
    assert policy.choose([a, b], ctx()) is b  # 4 against 2
    b.num_inflight = 5
    assert policy.choose([a, b], ctx()) is a  # b: 5 of ours now + 2 others'
    # a view that changes nothing of a's load is no new report of it
    registry.replace([inst("a", "decode", num_running=44), inst("b", "decode", num_running=7)])
    assert (a.queue_depth, b.queue_depth) == (4, 7)


def test_least_loaded_spreads_ties():
    policy = LeastLoaded()
    pool = [inst("a", "decode"), inst("b", "decode")]
    picks = {policy.choose(pool, ctx()).instance_id for _ in range(4)}
    assert picks == {"a", "b"}


def test_prefix_index_matches_leading_blocks_and_is_lru_bounded():
    index = PrefixIndex(max_blocks=10)
    c = ctx()
    index.record("a", c.hashes)
    assert index.match("a", c.hashes) == 8
    assert index.match("a", ctx(PROMPT[:32] + [999] * 32).hashes) == 4  # diverges at block 4
    assert index.match("b", c.hashes) == 0
    index.record("a", ctx(range(1000, 1064)).hashes)
    assert index.num_blocks("a") == 8  # bounded: the oldest chain went first, whole
    assert index.match("a", c.hashes) == 0 and index.match("a", ctx(range(1000, 1064)).hashes) == 8
    index.forget("a")
    assert index.num_blocks("a") == 0


def test_prefix_index_bound_is_for_all_engines_together_least_recent_first():
    index = PrefixIndex(max_blocks=40)
    chains = {f"e{i}": ctx(range(100 * i, 100 * i + 64)).hashes for i in range(10)}  # 8 blocks each
    for engine, hashes in chains.items():
        index.record(engine, hashes)
    assert index.num_routed_blocks() == 40  # not 10 x 8: the bound is the Coordinator's
    assert sum(index.num_blocks(e) for e in chains) == 40
    assert [index.match(e, h) for e, h in chains.items()] == [0] * 5 + [8] * 5  # the oldest went
    index.record("e5", chains["e5"])  # used again: now the newest
    index.record("e0", chains["e0"])  # evicts e6's chain, the least recently recorded
    assert [index.match(e, chains[e]) for e in ("e0", "e5", "e6", "e7")] == [8, 8, 0, 8]
    assert index.longest(chains["e6"], among=set(chains)) == (0, set())
    index.forget("e0")
    assert index.num_routed_blocks() == 32 and index.num_blocks("e0") == 0


def test_prefix_index_keeps_a_shared_prefix_while_any_chain_through_it_is_held():
    index = PrefixIndex(max_blocks=24)
    system = PROMPT[:32]  # 4 blocks every prompt starts with
    first, second, other = (ctx(system + list(range(s, s + 32))).hashes for s in (1000, 2000, 3000))
    index.record("a", first)
    index.record("a", second)
    assert index.num_routed_blocks() == 12  # the shared 4 counted once
    index.record("a", first)  # the same chain again: the newest, nothing added
    assert index.num_routed_blocks() == 12
    index.record("b", other)  # 20 entries: within the bound
    index.record("b", ctx(range(5000, 5064)).hashes)  # 28: the least recent chain goes, a's second
    assert index.num_routed_blocks() == 24
    assert index.match("a", second) == 4 and index.match("a", first) == 8  # its prefix stays with first
    assert index.longest(second, among={"a", "b"}) == (4, {"a", "b"})  # b's chain shares it too
    index.record("b", ctx(range(6000, 6064)).hashes)  # a's first goes: a holds nothing now
    assert index.num_blocks("a") == 0 and index.longest(first, among={"a", "b"}) == (4, {"b"})
    assert index.num_routed_blocks() == 24
    index.forget("b")
    assert index.num_routed_blocks() == 0 and index.longest(other, among={"a", "b"}) == (0, set())


def test_prefix_index_stays_consistent_and_bounded_through_random_routes_and_forgets():
    rng = random.Random(7)
    prompts = [ctx(PROMPT[:8 * rng.randint(0, 4)] + list(range(100 * i, 100 * i + 8 * rng.randint(1, 6)))).hashes
               for i in range(30)]  # some share a leading run of PROMPT's blocks
    engines, index = ("a", "b", "c"), PrefixIndex(max_blocks=50)
    for step in range(2000):
        engine = rng.choice(engines)
        if step % 97 == 96:
            index.forget(engine)
            assert index.num_blocks(engine) == 0
            continue
        hashes = rng.choice(prompts)
        index.record(engine, hashes)
        assert index.num_routed_blocks() == sum(index.num_blocks(e) for e in engines) <= 50
        assert index.match(engine, hashes) == len(hashes)  # the chain just routed is held whole
        for e in engines:
            for h in prompts:
                assert index.longest(h, among={e}) == (index.match(e, h), {e} if index.match(e, h) else set())


def test_prefix_cache_aware_follows_the_cache_unless_imbalanced():
    index = PrefixIndex(1000)
    policy = PrefixCacheAware(index)
    a, b = inst("a", "prefill", num_running=3), inst("b", "prefill")
    index.record("a", ctx().hashes)
    assert policy.choose([a, b], ctx()) is a  # holds the prefix, busier but balanced
    assert policy.choose([a, b], ctx(range(500, 564))) is b  # no match: least loaded
    # Below the cache threshold (2 of 8 blocks): least loaded.
    assert policy.choose([a, b], ctx(PROMPT[:16] + list(range(700, 748)))) is b
    a.num_running = BALANCE_ABS * 3
    assert policy.choose([a, b], ctx()) is b  # imbalanced: balance wins over cache
    assert policy.choose([a], ctx(range(500, 564))) is a  # a pool of one: no choice
    assert [policy.choose([a, b], ctx()) for _ in range(2)] == [b, b]  # and after it, the same


def test_slo_aware_estimates_queue_prompt_and_cache():
    index = PrefixIndex(1000)
    policy = SLOAware(index, "prefill")
    fast = inst("a", "prefill", prefill_tokens_per_s=10_000.0)
    slow = inst("b", "prefill", prefill_tokens_per_s=1_000.0)
    assert policy.choose([fast, slow], ctx()) is fast
    fast.num_pending_prefill_tokens = 50_000  # 5 s of queued prefill
    assert policy.choose([fast, slow], ctx()) is slow
    before = estimate_ttft_s(slow, ctx(), index)
    index.record("b", ctx().hashes)
    assert estimate_ttft_s(slow, ctx(), index) < before  # cached prefix is cheaper
    decode = SLOAware(index, "decode")
    assert decode.choose([inst("x", "decode", num_running=4), inst("y", "decode")], ctx()).instance_id == "y"
