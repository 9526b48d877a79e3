"""What every routing policy sees: the candidates of one pool and the request's context.

A policy is a small object with ``choose(candidates, ctx) -> EngineEndpoint``; it may keep
state (a cursor, an index) but never blocks and never calls the network. The
router calls ``choose`` with a non-empty list of routable instances.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.runtime.block_hash import hash_chain

from ..instances import EngineEndpoint, Pool


@dataclass
class RouteContext:
    prompt_token_ids: list[int]
    block_size: int
    _hashes: list[bytes] | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def hashes(self) -> list[bytes]:
        """The prompt's block-hash chain, computed once (same hashes as the engines')."""
        if self._hashes is None:
            self._hashes = hash_chain(self.prompt_token_ids, self.block_size)
        return self._hashes


class Policy:
    name = "base"

    def choose(self, candidates: list[EngineEndpoint], ctx: RouteContext) -> EngineEndpoint:
        raise NotImplementedError


def in_id_order(candidates: list[EngineEndpoint]) -> list[EngineEndpoint]:
    """``candidates`` sorted by instance id: a registry's ``Pool`` as it is."""
    if isinstance(candidates, Pool):
        return candidates
    return sorted(candidates, key=lambda i: i.instance_id)


def by_id(candidates: list[EngineEndpoint]) -> dict[str, EngineEndpoint]:
    """``candidates`` by instance id (a ``Pool``'s kept)."""
    if isinstance(candidates, Pool):
        return candidates.by_id
    return {i.instance_id: i for i in candidates}


def depth_range(candidates: list[EngineEndpoint]) -> tuple[int, int]:
    """The lowest and highest queue depth of ``candidates`` (a ``Pool``'s from its order)."""
    if isinstance(candidates, Pool):
        return candidates.order.depth_range()
    depths = [i.queue_depth for i in candidates]
    return min(depths), max(depths)


def least_queue(candidates: list[EngineEndpoint], start: int = 0) -> EngineEndpoint:
    """Smallest queue depth, then KV usage; ties broken from ``start`` (rotating over
    ``candidates``' order). A ``Pool``'s answer from its load order, O(log N)."""
    if isinstance(candidates, Pool):
        return candidates.order.least(start)
    n = len(candidates)
    best = candidates[start % n]
    for k in range(1, n):
        inst = candidates[(start + k) % n]
        if (inst.queue_depth, inst.kv_usage) < (best.queue_depth, best.kv_usage):
            best = inst
    return best
