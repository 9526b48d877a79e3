"""Conditional disaggregation: prefill a request on its decode engine, or on a prefill engine.

Disaggregation pays for a prefill engine's queue, a KV transfer and two control hops;
for a short prompt, or when P is backed up, D can prefill it sooner itself. But a
prefill on D stalls every stream D is decoding, which is what PD exists to prevent.
``decide`` is called by the router once the P/D pair is chosen.

Algorithm. ``uncached`` = prompt tokens D's prefix cache does not hold; each side's
queue is the prompt tokens this Coordinator sent there that are not prefilled yet:
  on_d = D's queue + uncached
  on_p = P's queue + uncached + PD_TRIP_TOKENS   (the transfer and hops, in tokens)
P and D run the same model, so tokens ahead compare directly, without rates.
1. Short prompt (``uncached <= local_prefill_max_tokens``): D (``short_prompt``),
   unless load-aware and ``on_p < on_d``: D has a burst of local prefills queued
   and P is free, so the trip is cheaper (``decode_busy``).
2. Longer prompt: P (``long_prompt``), unless load-aware and P's queue alone exceeds
   ``on_d``: P is backed up (``prefill_busy``) → D, guarded: never when D is decoding streams and
   the prompt would stall them longer than ``max_stall_s`` (the TPOT target when the
   spec sets one, else ``DEFAULT_MAX_STALL_S``) at D's observed prefill rate, nor
   while no rate is known (``stall_guard`` → P).

With the threshold at 0 and load-awareness off, every request disaggregates
(``disabled``). Thresholds: ``local_prefill_max_tokens`` (64 by default), ``PD_TRIP_TOKENS``,
``DEFAULT_MAX_STALL_S``. Cost: a few arithmetic operations on registry fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from .instances import EngineEndpoint

PD_TRIP_TOKENS = 32  # ~the exposed KV transfer and two control hops, in prefill tokens
DEFAULT_MAX_STALL_S = 0.1  # longest a prefill on D may pause D's streams without a TPOT SLO


@dataclass(frozen=True)
class Decision:
    on_decode: bool
    reason: str  # short_prompt | decode_busy | prefill_busy | stall_guard | long_prompt | disabled


def decide(p: EngineEndpoint, d: EngineEndpoint, uncached: int, max_tokens: int, load_aware: bool,
           max_stall_s: float | None) -> Decision:
    """Where ``uncached`` prompt tokens prefill for the pair (p, d); pure."""
    if max_tokens <= 0 and not load_aware:
        return Decision(False, "disabled")
    on_d = d.num_pending_prefill_tokens + uncached
    on_p = p.num_pending_prefill_tokens + uncached + PD_TRIP_TOKENS
    if uncached <= max_tokens:
        if load_aware and on_p < on_d:
            return Decision(False, "decode_busy")
        return Decision(True, "short_prompt")
    if not load_aware or p.num_pending_prefill_tokens <= on_d:
        return Decision(False, "long_prompt")
    rate = d.prefill_tokens_per_s or p.prefill_tokens_per_s
    stall_s = uncached / rate if rate else float("inf")
    if d.queue_depth > 0 and stall_s > (max_stall_s or DEFAULT_MAX_STALL_S):
        return Decision(False, "stall_guard")
    return Decision(True, "prefill_busy")
