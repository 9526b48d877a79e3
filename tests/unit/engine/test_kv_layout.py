"""KV layouts across tensor-parallel sizes (layout.py): which P rank each D head comes
from, the byte ranges a transfer moves, and what a pairing refuses."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine.kv_transfer.layout import KVLayout, head_runs, token_range_items
from pdserve.engine.kv_transfer.transport import wire


def layout(tp: int, heads: int = 4, base: int = 0, **changes) -> KVLayout:
    fields = dict(model_id="m", dtype="float32", block_size=4, num_layers=2, num_kv_heads=heads,
                  head_dim=8, dtype_bytes=4, num_blocks=16, base_addr=base, tp_size=tp)
    return KVLayout(**{**fields, **changes})


@pytest.mark.parametrize(("p", "d", "heads", "runs"), [
    (1, 1, 4, [(0, 0, 0, 0, 4)]),
    (2, 1, 4, [(0, 0, 0, 0, 2), (1, 0, 0, 2, 2)]),  # D's one rank gathers both P ranks
    (4, 2, 4, [(0, 0, 0, 0, 1), (1, 0, 0, 1, 1), (2, 0, 1, 0, 1), (3, 0, 1, 1, 1)]),
    # 2 heads over 4 P ranks: each replicated on two; only the lower of each pair sends
    (4, 1, 2, [(0, 0, 0, 0, 1), (2, 0, 0, 1, 1)]),
    (4, 2, 2, [(0, 0, 0, 0, 1), (2, 0, 1, 0, 1)]),
    # D replicating: both D ranks that hold head 0 get it
    (1, 4, 2, [(0, 0, 0, 0, 1), (0, 0, 1, 0, 1), (0, 1, 2, 0, 1), (0, 1, 3, 0, 1)]),
])
def test_every_d_head_comes_from_the_lowest_p_rank_holding_it(p, d, heads, runs):
    assert [tuple(r) for r in head_runs(layout(p, heads), layout(d, heads))] == runs


@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 1), (2, 2), (4, 2), (4, 1), (1, 2)])
@pytest.mark.parametrize("local_is_source", [True, False])
def test_items_cover_each_d_rank_once_and_land_in_whole_tokens(p, d, local_is_source):
    src, dst = layout(p, base=1 << 30), layout(d, base=1 << 40)
    local, remote = (src, dst) if local_is_source else (dst, src)
    blocks_src, blocks_dst = [3, 7, 1], [5, 2, 9]
    local_blocks, remote_blocks = (blocks_src, blocks_dst) if local_is_source else (blocks_dst, blocks_src)
    start, end = 2, 11  # a chunk starting mid-block
    items = token_range_items(local, remote, local_blocks, remote_blocks, range(2), start, end,
                              local_is_source=local_is_source)
    assert items.dtype == np.int64 and items.shape[1] == 3
    dst_col = 1 if local_is_source else 0
    assert items[:, 2].sum() == (end - start) * 2 * 2 * d * dst.local_kv_heads * dst.head_bytes
    # Where the bytes land: D's token slots of the chunk, each exactly once ...
    pieces = items[:, [dst_col, 2]]
    landing = wire.merge_adjacent(pieces[np.argsort(pieces[:, 0], kind="stable")])
    expected = []
    for rank in range(d):
        for layer in range(2):
            for kv in (0, 1):
                for t in range(start, end):
                    addr = dst.block_addr(layer, kv, blocks_dst[t // 4], rank) + (t % 4) * dst.token_bytes
                    expected.append([addr, dst.token_bytes])
    expected = wire.merge_adjacent(np.array(sorted(expected), dtype=np.int64))
    assert landing.tolist() == expected.tolist()
    # ... and in the order the items go, D's side already merges into runs of whole
    # tokens (the tcp receiver's iovecs), however P splits the heads.
    in_order = wire.merge_adjacent(items[:, [dst_col, 2]])
    assert (in_order[:, 1] % dst.token_bytes == 0).all()


def test_a_pairing_refuses_what_cannot_be_relaid_out_and_says_why():
    ours = layout(1)
    assert ours.mismatch(layout(2)) is None and ours.mismatch(layout(4)) is None
    assert "cannot be split over 3 ranks" in ours.mismatch(layout(3))
    assert "tp_size must be a positive integer" in ours.mismatch(layout(0))
    assert "num_kv_heads: 4 vs 8" in ours.mismatch(layout(2, heads=8))  # another model
    # A peer of the first protocol (no tp_size in its handshake) reads as TP=1 and is
    # refused by its version, not by a KeyError.
    old = {k: v for k, v in layout(1).to_dict().items() if k != "tp_size"}
    old["protocol_version"] = 1
    assert "protocol_version: 2 vs 1" in ours.mismatch(KVLayout.from_dict(old))


def test_the_region_holds_one_slab_per_rank():
    two = layout(2)
    assert two.local_kv_heads == 2 and two.token_bytes == 2 * 8 * 4
    assert two.region_bytes == 2 * two.rank_bytes
    assert two.block_addr(0, 0, 0, rank=1) == two.rank_bytes
    assert layout(4, heads=2).local_kv_heads == 1  # replicated: one head per rank
    assert layout(2).compat_hash == layout(1).compat_hash  # the split is not the model
