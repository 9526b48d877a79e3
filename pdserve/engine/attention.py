"""Paged attention over the block-structured KV cache (torch).

The runner flattens a step's tokens into one sequence ``[T]`` so the linear layers
see a single matmul; only attention needs to know where one request ends. Layout:
decode tokens (one per request) first, then each prefill chunk contiguously.

KV cache layout, one tensor for the whole engine::

    kv_cache[layer, 0|1 (K|V), block, slot_in_block, kv_head, head_dim]

Each (layer, K|V, block) is one contiguous run of bytes, which is what the KV
transfer moves. ``slot = block_id * block_size + offset`` indexes the flattened
``[num_blocks * block_size]`` axis.
"""

from __future__ import annotations

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


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V is written
    num_decodes: int = 0
    block_size: int = 16
    decode_blocks: torch.Tensor | None = None  # [B, max_blocks] block tables, 0-padded
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    on_kv_written=None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend.

    ``on_kv_written()`` fires between the two: the layer's KV is final from then on,
    so a layer-wise sender can start moving it while attention and the MLP compute.
    """
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if on_kv_written is not None:
        on_kv_written()
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        # Gather whole blocks (one contiguous copy per block, not one per token).
        b, kvh, hd, bs = nd, k_cache.shape[1], k_cache.shape[2], meta.block_size
        length = meta.decode_blocks.shape[1] * bs
        kd = k_cache.view(-1, bs * kvh * hd)[meta.decode_blocks].view(b, length, kvh, hd)
        vd = v_cache.view(-1, bs * kvh * hd)[meta.decode_blocks].view(b, length, kvh, hd)
        kd, vd = kd.transpose(1, 2), vd.transpose(1, 2)  # [B, KVH, L, D]
        qd = q[:nd].unsqueeze(2)  # [B, H, 1, D]
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )
        out[:nd] = od.squeeze(2)
    for chunk in meta.prefills:
        s, e = chunk.start, chunk.start + chunk.num_new
        qp = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.slots is None:
            kp = k[s:e].transpose(0, 1).unsqueeze(0)
            vp = v[s:e].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            kp = k_cache[chunk.slots].transpose(0, 1).unsqueeze(0)
            vp = v_cache[chunk.slots].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=chunk.mask, scale=scale, enable_gqa=True
            )
        out[s:e] = op.squeeze(0).transpose(0, 1)
    return out
