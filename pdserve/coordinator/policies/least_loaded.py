"""least_loaded: the engine with the fewest requests ahead, then the lowest KV usage.

Load per engine: ``queue_depth``: the legs this Coordinator has in flight there now
(exact), plus what the last Stats poll or Controller view reported beyond this
Coordinator's legs at the time (the others' load, up to one interval stale), then
``kv_usage = used / (used + free)`` blocks.
Algorithm: minimum of (queue_depth, kv_usage); ties go to the next engine after
the last pick, so equal engines share work.
Cost: O(log N) for a registry's whole pool (its ``LoadOrder``), else O(N) over the
N candidates (a retry's, or a pool some of whose pairs are not usable). No thresholds.
"""

from __future__ import annotations

from ..instances import EngineEndpoint
from .base import Policy, RouteContext, in_id_order, least_queue


class LeastLoaded(Policy):
    name = "least_loaded"

    def __init__(self) -> None:
        self._tick = 0

    def choose(self, candidates: list[EngineEndpoint], ctx: RouteContext) -> EngineEndpoint:
        self._tick += 1
        return least_queue(in_id_order(candidates), self._tick)
