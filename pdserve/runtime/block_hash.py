"""Content hashes of KV blocks, shared by the engine's prefix cache and the router.

A full block's hash chains its predecessor's, so equal hashes mean equal prefixes.
Stable across processes (not Python's ``hash``): a Coordinator computes the same
chain from a prompt that an engine computes from its cache.
"""

from __future__ import annotations

import hashlib
from array import array


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def hash_chain(token_ids: list[int], block_size: int) -> list[bytes]:
    """Hashes of every full block of ``token_ids``, in order."""
    hashes: list[bytes] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
