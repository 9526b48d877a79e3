"""round_robin: each pool's candidates in turn.

Algorithm: a cursor advanced by one per choice, modulo the candidate count.
Cost: O(1). No thresholds. Ignores load and cache: the baseline.
"""

from __future__ import annotations

from ..instances import EngineEndpoint
from .base import Policy, RouteContext, in_id_order


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, candidates: list[EngineEndpoint], ctx: RouteContext) -> EngineEndpoint:
        # Sorted by id so the rotation is stable while views are replaced.
        ordered = in_id_order(candidates)
        inst = ordered[self._cursor % len(ordered)]
        self._cursor += 1
        return inst
