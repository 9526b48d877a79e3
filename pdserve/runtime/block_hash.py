"""Content hashes of KV blocks, shared by the engine's prefix cache and the router.

A full block's hash chains its predecessor's, so equal hashes mean equal prefixes.
Stable across processes (not Python's ``hash``): a Coordinator computes the same
chain from a prompt that an engine computes from its cache.

A block's hash is the 16-byte BLAKE2b digest of its parent's hash (none for the
first block) followed by its token ids as signed 64-bit integers (``array("q")``,
the machine's byte order). ``hash_chain`` (the router's, once per attempt) reads a
whole prompt's bytes from one buffer and copies a prepared hasher rather than
making one per block; its hashes are ``hash_block``'s.
"""

from __future__ import annotations

import hashlib
from array import array

_BLAKE2B_16 = hashlib.blake2b(digest_size=16)  # copied: cheaper than a new one per block


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    h = _BLAKE2B_16.copy()
    if parent_hash is not None:
        h.update(parent_hash)
    h.update(array("q", token_ids))
    return h.digest()


def hash_chain(token_ids: list[int], block_size: int) -> list[bytes]:
    """Hashes of every full block of ``token_ids``, in order."""
    data = memoryview(array("q", token_ids)).cast("B")
    step = block_size * 8  # bytes per block
    hashes: list[bytes] = []
    h = _BLAKE2B_16.copy()
    for start in range(0, len(data) - step + 1, step):
        h.update(data[start : start + step])
        parent = h.digest()
        hashes.append(parent)
        h = _BLAKE2B_16.copy()
        h.update(parent)
    return hashes
