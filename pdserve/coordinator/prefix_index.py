"""Which KV block-hash chains each engine holds, for prefix-aware routing.

Two sources, per engine. An engine that publishes its prefix cache's events
(``KVEvents``, fed by ``kv_events.KVEventFeeds``) is known exactly: its set is what
its last snapshot and the events since say, so every Coordinator replica has the
same index, a restarted Coordinator rebuilds it from the snapshot, and evictions
are seen. For an engine that publishes nothing, the index records the chain of
every prompt this Coordinator routed to it (an estimate: the engine may have
evicted blocks since). These estimates share one bound, ``max_blocks`` (engine,
hash) entries for the whole Coordinator, not per engine (at 1,000 engines a
per-engine bound let the index grow a thousandfold). The recency is kept per recorded
chain, not per block: one LRU (``_lru``, an ``OrderedDict``) of (engine, the chain's
last hash), which names the whole chain as the hashes are chained, and per engine a
count of the recorded chains holding each hash (``_routed``). A prompt routed again is
one move in the LRU, not one per block; the chain least recently recorded, whichever
engine's, is evicted first, its hashes dropped where no other chain of that engine
holds them (a shared system prompt stays while any chain through it does), until the
distinct entries are back within the bound. An engine keeps a share as large as its
recent routes. A published set is not bounded here: it is what the engine's cache
holds, bounded by that cache.

A chain's first block also maps to the engines holding it (``_holders``; for an
engine that publishes, every block it holds, as its events do not say which blocks
open a chain): an engine that lacks a prompt's first block matches none of it, so
``longest`` asks only the engines holding it, not every engine of the pool.

Cost: ``record`` O(1) for a chain recorded before and O(B) a new one (each eviction
O(its chain's B)), ``match`` O(B) look-ups for a prompt of B blocks; ``longest``
O(H * B), H the engines of the pool holding its first block; ``apply`` O(events);
``forget`` O(the engine's entries).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container


class PrefixIndex:
    def __init__(self, max_blocks: int) -> None:
        """``max_blocks``: the most routed (engine, hash) entries held, all engines together."""
        self.max_blocks = max_blocks
        self._routed: dict[str, dict[bytes, int]] = {}  # engine -> hash -> its recorded chains holding it
        # (engine, a chain's last hash) -> the chain, least recently recorded first
        self._lru: OrderedDict[tuple[str, bytes], tuple[bytes, ...]] = OrderedDict()
        self._num_routed = 0  # distinct (engine, hash) entries in ``_routed``
        self._published: dict[str, set[bytes]] = {}
        self._holders: dict[bytes, set[str]] = {}  # first block (any, published) -> engines

    def record(self, instance_id: str, hashes: list[bytes]) -> None:
        """Called by the router once a request is routed to ``instance_id``; a no-op for
        an engine that publishes its events (they say what it holds)."""
        if instance_id in self._published or not hashes:
            return
        key = (instance_id, hashes[-1])
        if key in self._lru:
            self._lru.move_to_end(key)  # this very chain again: its blocks are all held
            return
        held = self._routed.setdefault(instance_id, {})
        if hashes[0] not in held:
            self._holders.setdefault(hashes[0], set()).add(instance_id)
        num_held = len(held)
        for h in hashes:
            held[h] = held.get(h, 0) + 1
        self._num_routed += len(held) - num_held
        self._lru[key] = tuple(hashes)  # its own copy: the caller's list is the caller's
        while self._num_routed > self.max_blocks:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        (instance_id, _), hashes = self._lru.popitem(last=False)
        held = self._routed[instance_id]
        for h in hashes:
            n = held[h] - 1
            if n:
                held[h] = n
            else:
                del held[h]
                self._num_routed -= 1
        if not held:
            del self._routed[instance_id]
        if hashes[0] not in held:  # its first block held by no other chain of it
            self._drop(hashes[0], instance_id)

    def apply(self, instance_id: str, snapshot: bool, stored, removed) -> None:
        """Called by the engine's event feed: a snapshot replaces what is known of it."""
        held = self._published.get(instance_id)
        if snapshot or held is None:
            self._forget_holders(instance_id)
            self._forget_routed(instance_id)
            held = self._published[instance_id] = set()
        for h in stored:
            if h not in held:
                held.add(h)
                self._holders.setdefault(h, set()).add(instance_id)
        for h in removed:
            if h in held:
                held.discard(h)
                self._drop(h, instance_id)

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

    def longest(self, hashes: list[bytes], among: Container[str]) -> tuple[int, set[str]]:
        """The longest leading run of the chain that engines of ``among`` (ids) probably
        hold, and which of them hold it: ``match``'s largest answer over ``among``, and
        whose it is. Called by the prefix-aware policy."""
        best, holders = 0, set()
        for i in self._holders.get(hashes[0], ()) if hashes else ():
            if i not in among:
                continue
            n = self.match(i, hashes)
            if n > best:
                best, holders = n, {i}
            elif n == best and n:
                holders.add(i)
        return best, holders

    def forget(self, instance_id: str) -> None:
        """Called when an engine restarted or left: its cache is gone."""
        self._forget_holders(instance_id)
        self._forget_routed(instance_id)
        self._published.pop(instance_id, None)

    def _forget_routed(self, instance_id: str) -> None:
        held = self._routed.pop(instance_id, None)
        if held is None:
            return
        self._num_routed -= len(held)
        for h in held:  # every chain's last hash is among its hashes
            self._lru.pop((instance_id, h), None)

    def _forget_holders(self, instance_id: str) -> None:
        for h in self._published.get(instance_id) or self._routed.get(instance_id) or ():
            self._drop(h, instance_id)

    def _drop(self, h: bytes, instance_id: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(instance_id)
            if not holders:
                del self._holders[h]

    def is_published(self, instance_id: str) -> bool:
        return instance_id in self._published

    def num_blocks(self, instance_id: str) -> int:
        return len(self._published.get(instance_id) or self._routed.get(instance_id) or ())

    def num_routed_blocks(self) -> int:
        """Routed entries held, all engines together (at most ``max_blocks``)."""
        return self._num_routed
