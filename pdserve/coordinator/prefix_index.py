"""Which KV block-hash chains each engine holds, for prefix-aware routing.

Two sources, per engine. An engine that publishes its prefix cache's events
(``KVEvents``, fed by ``kv_events.KVEventFeeds``) is known exactly: its set is what
its last snapshot and the events since say, so every Coordinator replica has the
same index, a restarted Coordinator rebuilds it from the snapshot, and evictions
are seen. For an engine that publishes nothing, the index records the chain of
every prompt this Coordinator routed to it (an estimate: the engine may have
evicted blocks since), at most ``max_blocks`` hashes, least recently routed
evicted first (an ``OrderedDict`` used as an LRU).

Cost: ``record`` O(B) and ``match`` O(B) look-ups for a prompt of B blocks;
``apply`` O(events).
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._routed: dict[str, OrderedDict[bytes, None]] = {}
        self._published: dict[str, set[bytes]] = {}

    def record(self, instance_id: str, hashes: list[bytes]) -> None:
        """Called by the router once a request is routed to ``instance_id``; a no-op for
        an engine that publishes its events (they say what it holds)."""
        if instance_id in self._published:
            return
        lru = self._routed.setdefault(instance_id, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.max_blocks:
            lru.popitem(last=False)

    def apply(self, instance_id: str, snapshot: bool, stored, removed) -> None:
        """Called by the engine's event feed: a snapshot replaces what is known of it."""
        held = self._published.get(instance_id)
        if snapshot or held is None:
            self._routed.pop(instance_id, None)
            held = self._published[instance_id] = set()
        held.update(stored)
        held.difference_update(removed)

    def match(self, instance_id: str, hashes: list[bytes]) -> int:
        """Number of leading blocks of the chain this engine (probably) holds."""
        held = self._published.get(instance_id)
        if held is None:
            held = self._routed.get(instance_id)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def forget(self, instance_id: str) -> None:
        """Called when an engine restarted or left: its cache is gone."""
        self._routed.pop(instance_id, None)
        self._published.pop(instance_id, None)

    def is_published(self, instance_id: str) -> bool:
        return instance_id in self._published

    def num_blocks(self, instance_id: str) -> int:
        return len(self._published.get(instance_id) or self._routed.get(instance_id) or ())
