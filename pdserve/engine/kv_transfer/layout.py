"""KV memory layout, the compatibility hash, and block tables → byte ranges.

Both engines keep ``kv[layer, K|V, block, slot, kv_head, head_dim]`` in one region,
so (layer, K|V, block) is a contiguous run and a token's K (or V) in one layer is
``token_bytes`` long. The handshake exchanges ``KVLayout``; the compatibility hash
covers everything that must match for bytes to mean the same thing on both sides.
A mismatch refuses the pairing before any byte moves.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from pdserve.engine.kv_transfer.transport.base import TransferItem

PROTOCOL_VERSION = 1

# Fields that must be equal on both sides (the rest, such as base_addr, is per engine).
COMPAT_FIELDS = ("model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim",
                 "protocol_version")


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    num_blocks: int
    base_addr: int
    protocol_version: int = PROTOCOL_VERSION

    @property
    def token_bytes(self) -> int:
        return self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.token_bytes

    @property
    def region_bytes(self) -> int:
        return self.num_layers * 2 * self.num_blocks * self.block_bytes

    @property
    def compat_hash(self) -> str:
        ident = {k: getattr(self, k) for k in COMPAT_FIELDS}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]

    def block_addr(self, layer: int, kv: int, block: int) -> int:
        return self.base_addr + ((layer * 2 + kv) * self.num_blocks + block) * self.block_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "compat_hash": self.compat_hash}

    @classmethod
    def from_dict(cls, raw: dict) -> KVLayout:
        fields = {k: raw[k] for k in cls.__dataclass_fields__}
        return cls(**fields)

    def mismatch(self, other: KVLayout) -> str | None:
        """A message naming the fields that differ, or None when compatible."""
        diffs = [f"{k}: {getattr(self, k)!r} vs {getattr(other, k)!r}"
                 for k in COMPAT_FIELDS if getattr(self, k) != getattr(other, k)]
        return "; ".join(diffs) or None


def token_range_items(
    local: KVLayout, remote: KVLayout, local_blocks: list[int], remote_blocks: list[int],
    layers: range, start: int, end: int,
) -> list[TransferItem]:
    """Byte runs for tokens [start, end) of one request in the given layers.

    Only the exact token slots are covered, never whole blocks, so two chunks of one
    prefill never write the same bytes.
    """
    bs, tb = local.block_size, local.token_bytes
    items: list[TransferItem] = []
    spans = []
    t = start
    while t < end:
        j = t // bs
        stop = min(end, (j + 1) * bs)
        spans.append((local_blocks[j], remote_blocks[j], (t - j * bs) * tb, (stop - t) * tb))
        t = stop
    for layer in layers:
        for kv in (0, 1):
            for lb, rb, off, n in spans:
                items.append(TransferItem(local.block_addr(layer, kv, lb) + off,
                                          remote.block_addr(layer, kv, rb) + off, n))
    return items
