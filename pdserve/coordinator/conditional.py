"""Conditional disaggregation: prefill a request on its decode engine, or on a prefill engine.

Disaggregation pays for a prefill engine's queue, a KV transfer and two control hops;
for a short prompt, or when P is backed up, D can prefill it sooner itself. But a
prefill on D stalls every stream D is decoding, which is what PD exists to prevent.
``decide`` is called by the router once the P/D pair is chosen.

Algorithm (``uncached`` = prompt tokens D's prefix cache does not hold):
1. ``short_prompt``: ``uncached <= local_prefill_max_tokens`` → D. About one decode
   step of work: cheaper than the trip through P.
2. ``prefill_busy`` (load-aware): P's predicted time to first token (its pending
   prefill tokens plus this prompt, over its observed prefill rate) exceeds the time
   D needs for the prompt (over D's rate, or P's while D's is unknown) → D.
3. Guard on both: never on D when D is decoding streams and the prompt would stall
   them longer than ``max_stall_s`` (the TPOT target when the spec sets one, else
   ``DEFAULT_MAX_STALL_S``): reason ``stall_guard``, the request disaggregates.
   Rule 1 needs no rate; rules 2 and 3 need one and are skipped while none is known
   (rule 2 then never fires; rule 3 never blocks rule 1's few tokens).
Otherwise ``long_prompt``: disaggregate.

Thresholds: ``local_prefill_max_tokens`` (64 by default), ``DEFAULT_MAX_STALL_S``.
Cost: a few arithmetic operations on fields the registry already holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from .instances import Instance

DEFAULT_MAX_STALL_S = 0.1  # longest a prefill on D may pause D's streams without a TPOT SLO


@dataclass(frozen=True)
class Decision:
    on_decode: bool
    reason: str  # short_prompt | prefill_busy | stall_guard | long_prompt | disabled


def decide(p: Instance, d: Instance, uncached: int, max_tokens: int, load_aware: bool,
           max_stall_s: float | None) -> Decision:
    """Where ``uncached`` prompt tokens prefill for the pair (p, d); pure."""
    if max_tokens <= 0 and not load_aware:
        return Decision(False, "disabled")
    d_rate = d.prefill_tokens_per_s or p.prefill_tokens_per_s
    on_d_s = uncached / d_rate if d_rate else None
    stall_limit = max_stall_s or DEFAULT_MAX_STALL_S
    d_busy = d.queue_depth > 0
    if uncached <= max_tokens:
        if d_busy and on_d_s is not None and on_d_s > stall_limit:
            return Decision(False, "stall_guard")
        return Decision(True, "short_prompt")
    if not load_aware or not p.prefill_tokens_per_s or on_d_s is None:
        return Decision(False, "long_prompt")
    on_p_s = (p.num_pending_prefill_tokens + uncached) / p.prefill_tokens_per_s
    if on_p_s <= on_d_s:
        return Decision(False, "long_prompt")
    if d_busy and on_d_s > stall_limit:
        return Decision(False, "stall_guard")
    return Decision(True, "prefill_busy")
