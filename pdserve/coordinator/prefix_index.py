"""Which KV block-hash chains each engine probably holds, for prefix-aware routing.

Engines do not publish KV cache events yet, so this index records the chain of
every prompt the Coordinator routed to an engine (prefill compute, or the decode
side that received the KV). It is an estimate: an engine may have evicted blocks
since. Bounds: at most ``max_blocks`` hashes per engine, least recently routed
evicted first (an ``OrderedDict`` used as an LRU).

Cost: ``record`` O(B) and ``match`` O(B) dict look-ups for a prompt of B blocks.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, instance_id: str, hashes: list[bytes]) -> None:
        """Called by the router once a request is routed to ``instance_id``."""
        lru = self._blocks.setdefault(instance_id, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.max_blocks:
            lru.popitem(last=False)

    def match(self, instance_id: str, hashes: list[bytes]) -> int:
        """Number of leading blocks of the chain this engine probably holds."""
        lru = self._blocks.get(instance_id)
        if not lru:
            return 0
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def forget(self, instance_id: str) -> None:
        """Called when an engine restarted or left: its cache is gone."""
        self._blocks.pop(instance_id, None)

    def num_blocks(self, instance_id: str) -> int:
        return len(self._blocks.get(instance_id, ()))
