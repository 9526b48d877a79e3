"""Decode attention in length buckets against a per-sequence reference.

Each decode row must see exactly its own context: the result equals gathering that
request's tokens alone and running one SDPA over them, whatever the other rows'
lengths, the block tables' order, or how the rows were bucketed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.attention import (
    AttentionMetadata,
    PrefillChunk,
    build_decode_buckets,
    paged_attention,
    plan_decode_buckets,
)

H, KVH, D, BS = 8, 2, 64, 16  # the `small` preset: GQA 8/2, head_dim 64, block 16
SCALE = D**-0.5


def make_cache(num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks * BS, KVH, D, generator=g)
    v = torch.randn(num_blocks * BS, KVH, D, generator=g)
    return k, v


def random_tables(lens: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Disjoint block tables drawn from a random permutation of the pool (block 0 included)."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for n in lens:
        k = -(-n // BS)
        tables.append(perm[used:used + k])
        used += k
    return tables


def reference(q, k_cache, v_cache, lens, tables) -> torch.Tensor:
    """Per sequence: gather its own ``len`` tokens slot by slot, then plain SDPA."""
    out = []
    for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        k = k_cache[slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, n, D]
        v = v_cache[slots].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q[i].view(1, H, 1, D), k, v, scale=SCALE, enable_gqa=True)
        out.append(o.view(H, D))
    return torch.stack(out)


def decode_only(q, k_cache, v_cache, lens, tables) -> torch.Tensor:
    """Run ``paged_attention`` on a decode-only step; this step's K/V go to spare slots."""
    b = len(lens)
    spare = torch.arange(k_cache.shape[0] - b, k_cache.shape[0])  # last block, never in a table
    meta = AttentionMetadata(
        slot_mapping=spare, num_decodes=b, block_size=BS,
        decode_buckets=build_decode_buckets(lens, tables, BS, torch.device("cpu")),
    )
    k_new = k_cache[spare].clone()
    return paged_attention(q, k_new, k_new.clone(), k_cache, v_cache, meta, SCALE)


CASES = {
    "all_short": [64, 60, 61, 70, 72, 64, 58, 66],
    "seven_short_one_long": [64, 60, 2048, 70, 72, 64, 58, 66],
    "all_long": [2048, 2000, 1990, 2047, 2033, 2048, 1900, 2010],
    "ladder": [1, 2, 15, 16, 17, 31, 32, 33, 100, 250, 513, 1024, 1025, 3],
    "single": [37],
    "equal_lengths": [48, 48, 48],
}


@pytest.mark.parametrize("lens", CASES.values(), ids=CASES.keys())
def test_decode_matches_per_sequence_reference(lens):
    num_blocks = sum(-(-n // BS) for n in lens) + 8
    k_cache, v_cache = make_cache(num_blocks, seed=len(lens))
    tables = random_tables(lens, num_blocks - 1, seed=sum(lens))
    q = torch.randn(len(lens), H, D, generator=torch.Generator().manual_seed(7))
    ours = decode_only(q, k_cache, v_cache, lens, tables)
    torch.testing.assert_close(ours, reference(q, k_cache, v_cache, lens, tables), atol=1e-5, rtol=1e-5)


def test_random_batches_match_reference():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        b = int(torch.randint(1, 17, (1,), generator=g))
        lens = [int(n) for n in torch.randint(1, 600, (b,), generator=g)]
        if trial % 3 == 0:
            lens[0] = 1500  # one long request among short ones
        num_blocks = sum(-(-n // BS) for n in lens) + 4
        k_cache, v_cache = make_cache(num_blocks, seed=trial)
        tables = random_tables(lens, num_blocks - 1, seed=trial)
        if trial % 2:  # tables may run past the context (blocks allocated ahead)
            tables = [t + [num_blocks - 1] * 3 for t in tables]
        q = torch.randn(b, H, D, generator=g)
        torch.testing.assert_close(
            decode_only(q, k_cache, v_cache, lens, tables),
            reference(q, k_cache, v_cache, lens, tables), atol=1e-5, rtol=1e-5,
        )


def test_mixed_step_decodes_then_prefill():
    """Decode rows first, then a prefill chunk over a cached prefix, in one call."""
    dec_lens = [20, 700, 33]
    chunk_ctx, chunk_new = 40, 8  # 32 cached tokens + 8 new
    num_blocks = sum(-(-n // BS) for n in dec_lens) + -(-chunk_ctx // BS) + 2
    k_cache, v_cache = make_cache(num_blocks, seed=3)
    tables = random_tables([*dec_lens, chunk_ctx], num_blocks, seed=3)
    chunk_table = tables.pop()
    chunk_slots = torch.tensor([chunk_table[p // BS] * BS + p % BS for p in range(chunk_ctx)])
    # This step writes each decode's last token and the chunk's 8 new tokens.
    dec_slots = [t[(n - 1) // BS] * BS + (n - 1) % BS for n, t in zip(dec_lens, tables, strict=True)]
    slot_mapping = torch.tensor(dec_slots + chunk_slots[-chunk_new:].tolist())
    t = len(dec_lens) + chunk_new
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(t, H, D, generator=g), torch.randn(t, KVH, D, generator=g), torch.randn(t, KVH, D, generator=g)
    q_pos = torch.arange(chunk_ctx - chunk_new, chunk_ctx).unsqueeze(1)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, num_decodes=len(dec_lens), block_size=BS,
        decode_buckets=build_decode_buckets(dec_lens, tables, BS, torch.device("cpu")),
        prefills=[PrefillChunk(len(dec_lens), chunk_new, chunk_ctx, chunk_slots,
                               torch.arange(chunk_ctx).unsqueeze(0) <= q_pos)],
    )
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE)

    # The cache now holds this step's K/V, so the reference reads the same cache.
    torch.testing.assert_close(
        out[:3], reference(q[:3], k_cache, v_cache, dec_lens, tables), atol=1e-5, rtol=1e-5
    )
    kp = k_cache[chunk_slots].transpose(0, 1).unsqueeze(0)
    vp = v_cache[chunk_slots].transpose(0, 1).unsqueeze(0)
    qp = q[3:].transpose(0, 1).unsqueeze(0)
    mask = torch.arange(chunk_ctx).unsqueeze(0) <= q_pos
    ref = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=SCALE, enable_gqa=True)
    torch.testing.assert_close(out[3:], ref.squeeze(0).transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_plan_keeps_similar_lengths_in_one_bucket_in_order():
    assert plan_decode_buckets([4, 5, 4, 5, 5, 4, 4, 5]) == [list(range(8))]


def test_plan_separates_one_long_from_short():
    buckets = plan_decode_buckets([4, 5, 128, 4, 5, 5, 4, 4])
    assert sorted(map(sorted, buckets)) == [[0, 1, 3, 4, 5, 6, 7], [2]]


@pytest.mark.parametrize("seed", range(5))
def test_plan_is_a_partition_at_least_as_cheap_as_one_bucket(seed):
    g = torch.Generator().manual_seed(seed)
    nb = [int(n) for n in torch.randint(1, 200, (int(torch.randint(1, 65, (1,), generator=g)),), generator=g)]
    buckets = plan_decode_buckets(nb, call_cost=8)
    assert sorted(i for b in buckets for i in b) == list(range(len(nb)))

    def cost(parts):
        return sum(8 + len(p) * max(nb[i] for i in p) for p in parts)

    assert cost(buckets) <= cost([list(range(len(nb)))])
    assert cost(buckets) <= cost([[i] for i in range(len(nb))])
