"""A pool's engines ordered by load, kept as their load changes, so that a policy finds
the least loaded engine of a pool of N without looking at all N.

Order: each engine's key is (``queue_depth``, ``kv_usage``, rank), its rank its place
in the pool's id order. The policies break ties by rotating over id order from a start
(``policies.base.least_queue``): the answer is the first key, at or after rank
``start`` (cyclically), of those with the lowest (``queue_depth``, ``kv_usage``): one
bisect of the sorted keys.

Kept: an engine tells each order it is in when a field its load is read from is
written (``EngineEndpoint.__setattr__``, ``LOAD_FIELDS``), whoever writes it (the legs'
counts, a view's figures); the order re-keys the engines so marked at its next read,
all at once when many were (a view).

Cost: a read O(log N) plus, per engine marked since the last one, O(log N) and a shift
of the key list (a memmove); after a view that marked most of them, one sort.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .instances import EngineEndpoint

RESORT_SHARE = 8  # more than 1/8 of the pool marked: sort all keys again


class LoadOrder:
    """Built by ``Pool.order`` on a policy's first read; lives as long as its pool."""

    def __init__(self, engines: list[EngineEndpoint]) -> None:
        """``engines`` in id order (copied: the order holds no reference to its pool, so
        a dropped pool is freed at once and its order with it)."""
        self.engines = list(engines)
        self._rank = {e.instance_id: r for r, e in enumerate(self.engines)}
        self._dirty: set[int] = set()
        self._key_at = [_key(e, r) for r, e in enumerate(self.engines)]
        self._keys = sorted(self._key_at)
        for e in self.engines:
            e.watch_load(self)

    def mark(self, engine: EngineEndpoint) -> None:
        """Called by the engine when a field of its load was written."""
        self._dirty.add(self._rank[engine.instance_id])

    def least(self, start: int) -> EngineEndpoint:
        """``least_queue``'s answer: the lowest (queue_depth, kv_usage), ties from ``start``."""
        keys = self._fresh()
        depth, usage, _ = keys[0]
        i = bisect.bisect_left(keys, (depth, usage, start % len(keys)))
        if i < len(keys) and keys[i][0] == depth and keys[i][1] == usage:
            return self.engines[keys[i][2]]
        return self.engines[keys[0][2]]

    def depth_range(self) -> tuple[int, int]:
        """The lowest and the highest queue depth of the pool."""
        keys = self._fresh()
        return keys[0][0], keys[-1][0]

    def _fresh(self) -> list[tuple]:
        dirty = self._dirty
        if not dirty:
            return self._keys
        if len(dirty) * RESORT_SHARE > len(self.engines):
            self._key_at = [_key(e, r) for r, e in enumerate(self.engines)]
            self._keys = sorted(self._key_at)
        else:
            keys = self._keys
            for r in dirty:
                del keys[bisect.bisect_left(keys, self._key_at[r])]
                key = self._key_at[r] = _key(self.engines[r], r)
                bisect.insort(keys, key)
        dirty.clear()
        return self._keys


def _key(e: EngineEndpoint, rank: int) -> tuple[int, float, int]:
    return e.queue_depth, e.kv_usage, rank
