"""Block manager on plain data: allocation, ref counts, prefix cache, LRU eviction.

A request is "computed" here by hand: allocate slots, advance ``num_computed_tokens``
and publish full blocks, which is what the scheduler and the engine's step do.
"""

from __future__ import annotations

import pytest

from pdserve.api.sampling import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.runtime.block_hash import hash_chain

BS = 4


def make_request(token_ids: list[int], request_id: str = "r") -> Request:
    return Request(request_id, token_ids, SamplingParams())


def admit(bm: BlockManager, request: Request) -> list[int]:
    """Admit like the scheduler: share the cached prefix, allocate and compute the rest."""
    cached = bm.find_cached_blocks(request)
    num_new = request.num_tokens - len(cached) * bm.block_size
    assert bm.allocate_slots(request, num_new, cached)
    compute(bm, request, num_new)
    return cached


def compute(bm: BlockManager, request: Request, num_new: int) -> None:
    request.num_computed_tokens += num_new
    bm.cache_full_blocks(request)


def ref_counts(bm: BlockManager, block_ids: list[int]) -> list[int]:
    return [bm._ref_count[b] for b in block_ids]


def cached_block_ids(bm: BlockManager, request: Request, n: int) -> list[int]:
    """The blocks the prefix cache holds for the first ``n`` blocks of ``request``."""
    return [bm._cached[h] for h in hash_chain(request.all_token_ids, bm.block_size)[:n]]


def assert_no_leak(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.num_used_blocks == 0
    assert all(c == 0 for c in bm._ref_count)


@pytest.fixture
def bm() -> BlockManager:
    return BlockManager(num_blocks=8, block_size=BS)


def test_allocate_grow_and_free(bm):
    req = make_request(list(range(10)))
    assert bm.allocate_slots(req, 10)
    assert len(req.block_table) == 3
    assert bm.num_free_blocks == 5
    assert ref_counts(bm, req.block_table) == [1, 1, 1]
    compute(bm, req, 10)

    # Decode steps: tokens 11 and 12 fit the third block, token 13 needs a fourth.
    for _ in range(2):
        req.output_token_ids.append(1)
        assert bm.allocate_slots(req, 1)
        compute(bm, req, 1)
    assert len(req.block_table) == 3
    req.output_token_ids.append(1)
    assert bm.allocate_slots(req, 1)
    assert len(req.block_table) == 4

    bm.free(req)
    assert req.block_table == []
    assert_no_leak(bm)


def test_prefix_hit_follows_the_hash_chain(bm):
    a = make_request(list(range(12)), "a")
    admit(bm, a)
    bm.free(a)

    # Same first two blocks, different third: two hits.
    b = make_request(list(range(8)) + [99, 99, 99, 99, 99], "b")
    assert bm.find_cached_blocks(b) == cached_block_ids(bm, a, 2)
    # Same second block but a different first: the chain breaks at block 0, no hits.
    c = make_request([7, 7, 7, 7] + list(range(4, 12)) + [0], "c")
    assert bm.find_cached_blocks(c) == []
    assert hash_chain(c.all_token_ids, BS)[1] != hash_chain(a.all_token_ids, BS)[1]
    assert_no_leak(bm)


def test_shared_prefix_between_two_live_requests(bm):
    prefix = list(range(100, 108))
    a = make_request(prefix + [1, 2, 3], "a")
    admit(bm, a)
    b = make_request(prefix + [4, 5], "b")
    cached = admit(bm, b)
    assert cached == a.block_table[:2]
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 10
    assert ref_counts(bm, cached) == [2, 2]
    assert bm.num_used_blocks == 4  # two shared, one tail each

    bm.free(a)
    assert ref_counts(bm, cached) == [1, 1]
    assert bm.num_used_blocks == 3
    bm.free(b)
    assert_no_leak(bm)


def test_leaves_at_least_one_token_uncached(bm):
    a = make_request(list(range(8)), "a")
    admit(bm, a)
    bm.free(a)
    # The whole prompt is cached, but the last token must be computed for its logits.
    same = make_request(list(range(8)), "same")
    assert len(bm.find_cached_blocks(same)) == 1
    one_block = make_request(list(range(4)), "one")
    assert bm.find_cached_blocks(one_block) == []
    longer = make_request(list(range(9)), "longer")
    assert len(bm.find_cached_blocks(longer)) == 2

    cached = admit(bm, same)
    assert same.num_cached_tokens == 4 and same.num_computed_tokens == 8
    assert len(cached) == 1
    bm.free(same)
    assert_no_leak(bm)


def test_lru_reuses_the_oldest_freed_block_and_forgets_its_hash():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request(list(range(8)), "a")
    b = make_request(list(range(50, 58)), "b")
    admit(bm, a)
    admit(bm, b)
    a_table, b_table = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)

    # a's blocks were freed first, so a fresh request evicts them, tail first.
    x = make_request(list(range(200, 208)), "x")
    assert bm.allocate_slots(x, 8)
    assert x.block_table == a_table[::-1]
    assert bm.find_cached_blocks(make_request(list(range(9)))) == []
    assert bm.find_cached_blocks(make_request(list(range(50, 59)))) == b_table
    bm.free(x)
    assert_no_leak(bm)


def test_shared_prefix_outlives_the_suffix_under_lru():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request(list(range(16)), "a")
    admit(bm, a)
    table = list(a.block_table)
    bm.free(a)
    # One new block: the tail block was freed first, so it goes; the prefix stays.
    x = make_request([9, 9, 9], "x")
    assert bm.allocate_slots(x, 3)
    assert x.block_table == [table[3]]
    assert bm.find_cached_blocks(make_request(list(range(17)))) == table[:3]
    bm.free(x)
    assert_no_leak(bm)


def test_allocate_slots_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request(list(range(12)), "a")
    admit(bm, a)
    big = make_request(list(range(300, 308)), "big")
    assert not bm.allocate_slots(big, 8)
    assert big.block_table == [] and big.num_computed_tokens == 0
    assert bm.num_free_blocks == 1
    bm.free(a)

    # Cached hits that sit in the free pool count against the free blocks too.
    hog = make_request(list(range(500, 508)), "hog")
    assert bm.allocate_slots(hog, 8)  # the never-used block and a's tail; a's prefix stays
    c = make_request(list(range(8)) + list(range(600, 610)), "c")
    cached = bm.find_cached_blocks(c)
    assert len(cached) == 2
    # Two free blocks, both the hits themselves: nothing left for c's other three.
    assert not bm.allocate_slots(c, c.num_tokens - 8, cached)
    assert c.block_table == [] and c.num_computed_tokens == 0 and c.num_cached_tokens == 0
    assert bm.num_free_blocks == 2
    assert ref_counts(bm, cached) == [0, 0]
    bm.free(hog)
    assert_no_leak(bm)


def test_duplicate_content_stays_private_and_counters_add_up(bm):
    a = make_request(list(range(8)) + [1], "a")
    b = make_request(list(range(8)) + [2], "b")
    # Both admitted before either computed: no hits, the same content twice.
    assert bm.allocate_slots(a, 9) and bm.allocate_slots(b, 9)
    compute(bm, a, 9)
    compute(bm, b, 9)
    assert not set(a.block_table) & set(b.block_table)
    assert bm.find_cached_blocks(make_request(list(range(9)))) == a.block_table[:2]
    bm.record_prefix_query(9, 8)
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (9, 8)
    bm.free(a)
    bm.free(b)
    assert_no_leak(bm)


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_request(list(range(12)), "a")
    admit(bm, a)
    bm.free(a)
    assert bm.find_cached_blocks(make_request(list(range(12)))) == []
    assert_no_leak(bm)


def test_reset_prefix_cache_forgets_free_blocks_only(bm):
    a = make_request(list(range(9)), "a")
    admit(bm, a)
    b = make_request(list(range(50, 59)), "b")
    admit(bm, b)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.find_cached_blocks(make_request(list(range(9)))) == []
    assert bm.find_cached_blocks(make_request(list(range(50, 59)))) == b.block_table[:2]
    bm.free(b)
    assert_no_leak(bm)
