"""slo_aware: the engine with the lowest estimated time to first token.

Estimate for a prefill candidate (seconds):
  ttft = (pending_prefill_tokens + uncached_prompt_tokens) / prefill_tokens_per_s
         + prompt_tokens * TRANSFER_S_PER_TOKEN
where pending_prefill_tokens are prompt tokens this Coordinator sent there that
are not prefilled yet, uncached_prompt_tokens discounts the prefix the engine
probably holds (``PrefixIndex``), and prefill_tokens_per_s is learned per engine
from the engines' reported prefill timings (EWMA), DEFAULT_PREFILL_TOKENS_PER_S
until then. For a decode candidate the estimate is its queue depth (TPOT grows
with the decode batch).
Thresholds: DEFAULT_PREFILL_TOKENS_PER_S = 2000 (a cold start guess, replaced by
the learned rate after the first request), TRANSFER_S_PER_TOKEN = 2e-6 (about
100 KiB of KV per token over a 50 GB/s link; exposed transfer is small next to
prefill unless the pool is idle).
When every estimate misses ``ttft_slo_s`` the minimum is still chosen and the
router counts a predicted SLO miss.
Cost: O(N * B) for N prefill candidates and B prompt blocks; a decode pool's choice
is least_loaded's.
"""

from __future__ import annotations

from ..instances import EngineEndpoint
from ..prefix_index import PrefixIndex
from .base import Policy, RouteContext, in_id_order, least_queue

DEFAULT_PREFILL_TOKENS_PER_S = 2000.0
TRANSFER_S_PER_TOKEN = 2e-6


def estimate_ttft_s(inst: EngineEndpoint, ctx: RouteContext, index: PrefixIndex | None) -> float:
    cached = index.match(inst.instance_id, ctx.hashes) * ctx.block_size if index else 0
    uncached = max(1, ctx.num_tokens - cached)
    rate = inst.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
    return (inst.num_pending_prefill_tokens + uncached) / rate + ctx.num_tokens * TRANSFER_S_PER_TOKEN


class SLOAware(Policy):
    name = "slo_aware"

    def __init__(self, index: PrefixIndex | None, pool: str = "prefill") -> None:
        self.index = index
        self.pool = pool
        self._tick = 0
        self.last_estimate_s = 0.0

    def choose(self, candidates: list[EngineEndpoint], ctx: RouteContext) -> EngineEndpoint:
        self._tick += 1
        ordered = in_id_order(candidates)
        if self.pool != "prefill":
            return least_queue(ordered, self._tick)
        n = len(ordered)
        best, best_s = None, float("inf")
        for k in range(n):
            inst = ordered[(self._tick + k) % n]
            est = estimate_ttft_s(inst, ctx, self.index)
            if est < best_s:
                best, best_s = inst, est
        self.last_estimate_s = best_s
        return best
