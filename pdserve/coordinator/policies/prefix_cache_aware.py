"""prefix_cache_aware: send a prompt where its prefix's KV probably is, unless that
engine is much busier than the rest (sgl-router's cache-aware policy).

Thresholds:
  CACHE_THRESHOLD = 0.5     route by cache only when the best engine holds at least
                            this fraction of the prompt's full blocks
  BALANCE_ABS = 32          ... and the pool is balanced: max - min queue depth
  BALANCE_REL = 1.5         <= BALANCE_ABS or max <= BALANCE_REL * min
Algorithm: if the pool is imbalanced, pick the least loaded engine. Otherwise take
the engine matching the longest leading run of block hashes (``PrefixIndex``); if
that covers at least CACHE_THRESHOLD of the blocks pick it (ties: least loaded),
else pick the least loaded (its choice is recorded by the router, so the next
prompt with this prefix follows it).
Cost: for a registry's whole pool (``Pool``), O(log N) for the load and O(B * H) for
the cache, H the engines holding one of the prompt's B full blocks
(``PrefixIndex.longest``), plus O(T) for T engines tied on the longest match; for
other candidates O(N) more. None for a pool of one.
The index is the Coordinator's estimate (see ``prefix_index``), not engine events.
"""

from __future__ import annotations

from ..instances import EngineEndpoint
from ..prefix_index import PrefixIndex
from .base import Policy, RouteContext, by_id, depth_range, in_id_order, least_queue

CACHE_THRESHOLD = 0.5
BALANCE_ABS = 32
BALANCE_REL = 1.5


class PrefixCacheAware(Policy):
    name = "prefix_cache_aware"

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._tick = 0

    def choose(self, candidates: list[EngineEndpoint], ctx: RouteContext) -> EngineEndpoint:
        self._tick += 1
        if len(candidates) == 1:  # no choice: neither load nor the index can change it
            return candidates[0]
        ordered = in_id_order(candidates)
        lo, hi = depth_range(ordered)
        imbalanced = hi - lo > BALANCE_ABS and hi > BALANCE_REL * lo
        hashes = ctx.hashes
        if imbalanced or not hashes:
            return least_queue(ordered, self._tick)
        engines = by_id(ordered)
        best, holders = self.index.longest(hashes, engines)
        if best / len(hashes) < CACHE_THRESHOLD:
            return least_queue(ordered, self._tick)
        tied = [engines[i] for i in sorted(holders)]  # in id order, as ``ordered``
        return least_queue(tied, self._tick)
