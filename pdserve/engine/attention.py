"""Paged attention over the block-structured KV cache (torch).

The runner flattens a step's tokens into one sequence ``[T]`` so the linear layers
see a single matmul; only attention needs to know where one request ends. Layout:
decode tokens (one per request) first, then each prefill chunk contiguously.

KV cache layout, one tensor for the whole engine::

    kv_cache[layer, 0|1 (K|V), block, slot_in_block, kv_head, head_dim]

Each (layer, K|V, block) is one contiguous run of bytes, which is what the KV
transfer moves. ``slot = block_id * block_size + offset`` indexes the flattened
``[num_blocks * block_size]`` axis.

Decode path. Each decode token attends over its own request's context, gathered
whole blocks at a time into a dense ``[b, KVH, L, D]`` tensor for one SDPA call. A
batch is split into buckets of similar length so one long request does not make
every short one in the batch pay for its length (a single bucket padded to the
longest costs B x max_len; buckets cost about the sum of the lengths).

- Algorithm (``plan_decode_buckets``, once per step in the runner): sort the decodes
  by block count and split the sorted list into contiguous buckets, choosing the
  splits by dynamic programming to minimise the sum over buckets of
  ``DECODE_CALL_COST_BLOCKS + num_seqs * max_blocks``. A bucket is padded to its
  own longest context (in tokens) and masked; a bucket whose contexts are all the
  same length (one request, say) needs no mask.
- Threshold: ``DECODE_CALL_COST_BLOCKS = 8``, the fixed cost of one more bucket (two
  gathers, an SDPA call, the row gather and scatter: about 25 us on one CPU thread)
  in units of one sequence's block (gather + attention: about 3 us). Measured with
  ``benchmarks/decode_attention.py --call-cost N``: 4 to 16 are equal within noise;
  0 to 2 split 8 requests of 60-72 tokens (4 and 5 blocks) into two buckets and lose
  the gain on an all-short batch.
- Cost: O(B^2) Python per step for B decodes: 0.01 ms at 8, 0.4 ms at 64 (the
  default ``max_num_seqs``). With one bucket (similar lengths, the common case) the
  path is one gather and one SDPA over the decode rows in order, no row scatter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # offset in the flat token array
    num_new: int
    context_len: int  # tokens in cache after this chunk (cached prefix + new)
    slots: torch.Tensor | None  # [context_len] cache slots; None when no prefix is cached
    mask: torch.Tensor | None  # [num_new, context_len] bool; None means plain causal
    # Read by the native kernel instead (``kernel_prefill``): each new token a row of its
    # own over the cache, [num_new, blocks] block tables and [num_new] contexts.
    tables: torch.Tensor | None = None
    lens: torch.Tensor | None = None


@dataclass
class DecodeBucket:
    rows: torch.Tensor | None  # [b] decode rows (token indices < num_decodes); None: all, in order
    blocks: torch.Tensor  # [b, max_blocks] block tables, 0-padded to this bucket's longest
    context_len: int  # longest context in the bucket, in tokens
    mask: torch.Tensor | None  # [b, 1, 1, context_len] bool; None when every context is context_len
    lens: torch.Tensor | None = None  # [b] each row's context (sliding windows mask by it)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int = 0
    block_size: int = 16
    decode_buckets: list[DecodeBucket] = field(default_factory=list)  # cover rows [0, num_decodes)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Masks of sliding-window layers, built by the first such layer of a step and reused
    # by the others: (window, "prefill" or "decode", chunk or bucket index) -> mask.
    window_masks: dict = field(default_factory=dict)
    # The native kernel reading the decode rows' KV in place (native.PagedDecode; the
    # runner then plans a single bucket, rows in order); None: gather, then SDPA.
    decode_kernel: object = None

    def prefill_mask(self, index: int, window: int | None) -> torch.Tensor | None:
        """Prefill chunk ``index``'s mask: causal, and within ``window`` if one is given
        (None: plain causal with no cached prefix, as ``PrefillChunk.mask`` means)."""
        chunk = self.prefills[index]
        if window is None or chunk.context_len <= window:
            return chunk.mask

        def build(device):
            q_pos = torch.arange(chunk.context_len - chunk.num_new, chunk.context_len,
                                 device=device).unsqueeze(1)
            k_pos = torch.arange(chunk.context_len, device=device).unsqueeze(0)
            return (k_pos <= q_pos) & (q_pos - k_pos < window)
        return self._window_mask((window, "prefill", index), build)

    def decode_mask(self, index: int, window: int | None) -> torch.Tensor | None:
        """Decode bucket ``index``'s mask, within ``window`` if one is given: each row
        attends to its last ``window`` tokens (its new one included)."""
        bucket = self.decode_buckets[index]
        if window is None or bucket.context_len <= window:
            return bucket.mask

        def build(device):
            pos = torch.arange(bucket.context_len, device=device).view(1, 1, 1, -1)
            lens = bucket.lens.to(device).view(-1, 1, 1, 1)
            return (pos < lens) & (pos >= lens - window)
        return self._window_mask((window, "decode", index), build)

    def _window_mask(self, key: tuple, build) -> torch.Tensor:
        if key not in self.window_masks:
            self.window_masks[key] = build(self.slot_mapping.device)
        return self.window_masks[key]


DECODE_CALL_COST_BLOCKS = 8
# A prefill chunk whose context is at most this many tokens is read by the native kernel
# (each new token a row, causal by its own length) where it runs: 1.42x SDPA's flash
# attention at 200 tokens, 1.35x at 512, 0.95x at 1,024 (SmolLM2's shapes, one core,
# AVX-512 BF16; docs/benchmarks.md).
KERNEL_PREFILL_MAX_CONTEXT = 768


def plan_decode_buckets(num_blocks: list[int], call_cost: int = DECODE_CALL_COST_BLOCKS) -> list[list[int]]:
    """Split decode rows into buckets (lists of row indices) minimising
    ``sum(call_cost + len(bucket) * max_blocks(bucket))``; pure, no torch.

    Buckets are contiguous runs of the rows sorted by block count, so the optimum is
    a 1-D partition: ``best[j]`` is the cheapest split of the ``j`` shortest rows.
    """
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__)
    n = [num_blocks[i] for i in order]
    best = [0] * (len(n) + 1)
    start = [0] * (len(n) + 1)
    for j in range(1, len(n) + 1):
        best[j], start[j] = min(
            (best[i] + call_cost + (j - i) * n[j - 1], i) for i in range(j)
        )
    buckets: list[list[int]] = []
    j = len(n)
    while j:
        buckets.append(order[start[j]:j])
        j = start[j]
    if len(buckets) == 1:
        return [list(range(len(num_blocks)))]  # keep the rows in order: no scatter needed
    return buckets[::-1]


def build_decode_buckets(
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    call_cost: int = DECODE_CALL_COST_BLOCKS,
) -> list[DecodeBucket]:
    """Bucket tensors for one step's decodes; called by the runner once per step.

    ``context_lens[i]`` counts the tokens row ``i`` attends over (its new token
    included); ``block_tables[i]`` holds at least ``ceil(context_lens[i] / block_size)``
    blocks.
    """
    num_blocks = [-(-n // block_size) for n in context_lens]
    # An infinite call cost: one bucket, rows in order (the native kernel takes each row's length).
    plan = [list(range(len(num_blocks)))] if call_cost == math.inf else plan_decode_buckets(num_blocks, call_cost)
    buckets = []
    for rows in plan:
        lens = [context_lens[i] for i in rows]
        max_len, max_blocks = max(lens), max(num_blocks[i] for i in rows)
        own = [block_tables[i][:num_blocks[i]] for i in rows]
        blocks = torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in own], dtype=torch.long, device=device
        )
        mask = None
        if min(lens) != max_len and call_cost != math.inf:  # the kernel needs no mask
            lens_t = torch.tensor(lens, device=device).unsqueeze(1)
            mask = (torch.arange(max_len, device=device).unsqueeze(0) < lens_t).view(len(rows), 1, 1, max_len)
        row_t = None if len(plan) == 1 else torch.tensor(rows, dtype=torch.long, device=device)
        buckets.append(DecodeBucket(row_t, blocks, max_len, mask, torch.tensor(lens)))
    return buckets


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    on_kv_written=None,
    window: int | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend (each token to itself and the
    ``window - 1`` before it, with a sliding ``window``; to its whole context without).

    ``on_kv_written()`` fires between the two: the layer's KV is final from then on,
    so a layer-wise sender can start moving it while attention and the MLP compute.
    """
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if on_kv_written is not None:
        on_kv_written()
    out = None
    nd = meta.num_decodes
    kernel = meta.decode_kernel
    if nd and kernel is not None:  # the runner planned one bucket for it
        bucket = meta.decode_buckets[0]
        od = kernel(q[:nd], k_cache, v_cache, bucket.blocks, bucket.lens, meta.block_size, scale, window)
        if nd == q.shape[0]:
            return od  # a step of decodes only
        out = torch.empty_like(q)
        out[:nd] = od
        nd = 0  # done: no bucket below
    if out is None:
        out = torch.empty_like(q)
    for i, bucket in enumerate(meta.decode_buckets if nd else ()):
        qd = q[:nd] if bucket.rows is None else q.index_select(0, bucket.rows)
        od = _decode_bucket(qd, k_cache, v_cache, bucket, meta.block_size, scale,
                            meta.decode_mask(i, window))
        if bucket.rows is None:
            out[:nd] = od
        else:
            out.index_copy_(0, bucket.rows, od)
    for i, chunk in enumerate(meta.prefills):
        s, e = chunk.start, chunk.start + chunk.num_new
        if chunk.tables is not None:  # causal: token t of the chunk attends to its context
            out[s:e] = kernel(q[s:e], k_cache, v_cache, chunk.tables, chunk.lens, meta.block_size, scale, window)
            continue
        qp = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        mask = meta.prefill_mask(i, window)
        if chunk.slots is None:
            kp = k[s:e].transpose(0, 1).unsqueeze(0)
            vp = v[s:e].transpose(0, 1).unsqueeze(0)
        else:
            kp = k_cache[chunk.slots].transpose(0, 1).unsqueeze(0)
            vp = v_cache[chunk.slots].transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        out[s:e] = op.squeeze(0).transpose(0, 1)
    return out


def _decode_bucket(
    q: torch.Tensor,  # [b, H, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bucket: DecodeBucket,
    block_size: int,
    scale: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    # Gather whole blocks: one contiguous copy per block, not one per token.
    # index_select on the flat block ids measured about twice as fast as cache[blocks].
    b, max_blocks = bucket.blocks.shape
    kvh, hd = k_cache.shape[1], k_cache.shape[2]
    ids = bucket.blocks.view(-1)
    shape = (b, max_blocks * block_size, kvh, hd)
    kd = k_cache.view(-1, block_size * kvh * hd).index_select(0, ids).view(shape)
    vd = v_cache.view(-1, block_size * kvh * hd).index_select(0, ids).view(shape)
    length = bucket.context_len
    kd, vd = kd[:, :length].transpose(1, 2), vd[:, :length].transpose(1, 2)  # [b, KVH, L, D]
    od = F.scaled_dot_product_attention(
        q.unsqueeze(2), kd, vd, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return od.squeeze(2)
