"""What every routing policy sees: the candidates of one pool and the request's context.

A policy is a small object with ``choose(candidates, ctx) -> EngineEndpoint``; it may keep
state (a cursor, an index) but never blocks and never calls the network. The
router calls ``choose`` with a non-empty list of routable instances.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.runtime.block_hash import hash_chain

from ..instances import EngineEndpoint


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


def least_queue(candidates: list[EngineEndpoint], start: int = 0) -> EngineEndpoint:
    """Smallest queue depth, then KV usage; ties broken from ``start`` (rotating)."""
    n = len(candidates)
    best = candidates[start % n]
    for k in range(1, n):
        inst = candidates[(start + k) % n]
        if (inst.queue_depth, inst.kv_usage) < (best.queue_depth, best.kv_usage):
            best = inst
    return best
