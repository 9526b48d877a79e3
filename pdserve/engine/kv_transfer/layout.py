"""KV memory layout, the compatibility hash, and block tables → byte ranges.

An engine keeps ``kv[rank, layer, K|V, block, slot, kv_head, head_dim]`` in one region:
one slab per tensor-parallel rank (``tp_size`` 1: one slab), each rank holding its own
KV heads (``kv_heads_of``). So (rank, layer, K|V, block) is a contiguous run, and a
token's K (or V) in one layer on one rank is ``token_bytes`` long. The handshake
exchanges ``KVLayout``; the compatibility hash covers everything that must match for
bytes to mean the same thing on both sides (the model's whole KV head count, not how
each side splits it). A mismatch refuses the pairing before any byte moves.

Two engines may split the heads differently (P at TP 2, D at TP 1): ``head_runs`` maps
every head each destination rank holds to the lowest source rank holding it, and
``token_range_items`` moves whole (rank, layer, K|V, block) runs where both sides hold
the same heads, else each token's slice of heads into its head offset on the other
side (strided items: one per token and run of heads).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

from pdserve.engine.config import kv_heads_of, split_error

PROTOCOL_VERSION = 2  # 2: the region holds one slab per tensor-parallel rank

# Fields that must be equal on both sides (the rest, such as base_addr, is per engine).
COMPAT_FIELDS = ("model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim",
                 "protocol_version")


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int  # the model's, over all ranks
    head_dim: int
    dtype_bytes: int
    num_blocks: int
    base_addr: int
    tp_size: int = 1
    protocol_version: int = PROTOCOL_VERSION

    @property
    def local_kv_heads(self) -> int:
        """KV heads in each rank's slab."""
        return kv_heads_of(0, self.tp_size, self.num_kv_heads)[1]

    @property
    def head_bytes(self) -> int:
        return self.head_dim * self.dtype_bytes

    @property
    def token_bytes(self) -> int:
        """One token's K (or V) of one layer in one rank's slab."""
        return self.local_kv_heads * self.head_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.token_bytes

    @property
    def rank_bytes(self) -> int:
        return self.num_layers * 2 * self.num_blocks * self.block_bytes

    @property
    def region_bytes(self) -> int:
        return self.tp_size * self.rank_bytes

    @property
    def compat_hash(self) -> str:
        ident = {k: getattr(self, k) for k in COMPAT_FIELDS}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]

    def block_addr(self, layer: int, kv: int, block, rank: int = 0):
        """Start of (rank, layer, K|V, block); ``block`` may be an int array."""
        return (self.base_addr + rank * self.rank_bytes
                + ((layer * 2 + kv) * self.num_blocks + block) * self.block_bytes)

    def to_dict(self) -> dict:
        return {**asdict(self), "compat_hash": self.compat_hash}

    @classmethod
    def from_dict(cls, raw: dict) -> KVLayout:
        fields = {k: raw[k] for k in cls.__dataclass_fields__ if k != "tp_size"}
        return cls(**fields, tp_size=raw.get("tp_size", 1))

    def mismatch(self, other: KVLayout) -> str | None:
        """A message naming the fields that differ, or why ``other``'s split of the heads
        cannot be re-laid out into ours; None when compatible."""
        diffs = [f"{k}: {getattr(self, k)!r} vs {getattr(other, k)!r}"
                 for k in COMPAT_FIELDS if getattr(self, k) != getattr(other, k)]
        if not diffs and (error := split_error(other.tp_size, other.num_kv_heads)):
            diffs.append(f"peer's tensor parallelism: {error}")
        return "; ".join(diffs) or None


class HeadRun(NamedTuple):
    """``count`` consecutive KV heads at head ``src_head`` of source rank ``src_rank``'s
    slab, going to head ``dst_head`` of destination rank ``dst_rank``'s."""

    src_rank: int
    src_head: int
    dst_rank: int
    dst_head: int
    count: int


def head_runs(src: KVLayout, dst: KVLayout) -> list[HeadRun]:
    """Where every head of every destination rank comes from: the lowest source rank
    holding it (a head replicated on several source ranks is sent once per destination
    rank that holds it), merged into runs contiguous on both sides."""
    runs: list[HeadRun] = []
    for d_rank in range(dst.tp_size):
        d_first, d_count = kv_heads_of(d_rank, dst.tp_size, dst.num_kv_heads)
        for h in range(d_first, d_first + d_count):
            if src.num_kv_heads >= src.tp_size:
                s_rank = h // src.local_kv_heads
            else:
                s_rank = h * (src.tp_size // src.num_kv_heads)
            s_head = h - kv_heads_of(s_rank, src.tp_size, src.num_kv_heads)[0]
            last = runs[-1] if runs else None
            if (last is not None and last.src_rank == s_rank and last.dst_rank == d_rank
                    and last.src_head + last.count == s_head
                    and last.dst_head + last.count == h - d_first):
                runs[-1] = last._replace(count=last.count + 1)
            else:
                runs.append(HeadRun(s_rank, s_head, d_rank, h - d_first, 1))
    return runs


def token_range_items(
    local: KVLayout, remote: KVLayout, local_blocks: list[int], remote_blocks: list[int],
    layers: range, start: int, end: int, *, local_is_source: bool = True,
) -> np.ndarray:
    """Byte runs (int64 array: local_addr, remote_addr, length) for tokens [start, end)
    of one request in the given layers; ``local_is_source`` False for reads (D pulls).

    Only the exact token slots are covered, never whole blocks, so two chunks of one
    prefill never write the same bytes.
    """
    src, dst = (local, remote) if local_is_source else (remote, local)
    src_blocks, dst_blocks = (local_blocks, remote_blocks) if local_is_source else (
        remote_blocks, local_blocks)
    bs = src.block_size
    tokens = np.arange(start, end, dtype=np.int64)
    src_tok = np.asarray(src_blocks, dtype=np.int64)[tokens // bs]
    dst_tok = np.asarray(dst_blocks, dtype=np.int64)[tokens // bs]
    slot = tokens % bs
    # Spans: tokens of one block, contiguous on both sides when a whole token moves.
    first = np.flatnonzero(np.concatenate(([True], slot[1:] != slot[:-1] + 1))) if len(tokens) \
        else np.zeros(0, dtype=np.int64)
    span_len = np.diff(np.append(first, len(tokens)))
    # Both sides hold the same number of heads per rank: every run is a whole token (the
    # splits are equal, or both replicate), so whole spans of tokens move at once.
    whole = src.local_kv_heads == dst.local_kv_heads
    parts = []
    for run in head_runs(src, dst):
        if whole:
            s_blk, d_blk, off, n = src_tok[first], dst_tok[first], slot[first], span_len
        else:
            s_blk, d_blk, off, n = src_tok, dst_tok, slot, np.ones_like(slot)
        for layer in layers:
            for kv in (0, 1):
                s = src.block_addr(layer, kv, s_blk, run.src_rank) + off * src.token_bytes
                d = dst.block_addr(layer, kv, d_blk, run.dst_rank) + off * dst.token_bytes
                if whole:
                    length = n * src.token_bytes
                else:
                    s = s + run.src_head * src.head_bytes
                    d = d + run.dst_head * dst.head_bytes
                    length = n * (run.count * src.head_bytes)
                a, b = (s, d) if local_is_source else (d, s)
                parts.append(np.stack([a, b, length], axis=1))
    if not parts:
        return np.zeros((0, 3), dtype=np.int64)
    items = np.concatenate(parts)
    if not whole:  # in destination order: each token's runs side by side (wire.merge_adjacent)
        items = items.reshape(len(parts) // (2 * len(layers)), -1, 3).transpose(1, 0, 2)
    return items.reshape(-1, 3)
