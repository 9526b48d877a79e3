"""Hybrid fallback: the cluster mode (PD, FALLBACK or COLOCATED) and each instance's
target role.

Algorithm (pure; the Controller calls ``evaluate`` every tick):

- COLOCATED when the spec configures no prefill or decode pool (only the hybrid
  pool: the colocated baseline). Nothing is missing, nothing falls back; every
  instance keeps its hybrid role. Hybrid-pool instances never count as a pool
  here in any mode: they are routable as they are.
- PD -> FALLBACK at once when a configured pool (prefill or decode) has no alive
  instance (READY, or DRAINING for a role switch), counted by *assigned* role.
  Not before the cluster was complete once, or ``startup_grace_s`` passed, so a
  pool that merely loads slower at start does not trip it.
- In FALLBACK with policy ``hybrid``, instances of the surviving pools switch to
  hybrid (they serve whole requests); instances of the missing pool keep their
  role, so that when one comes back the pool is whole again.
- FALLBACK -> PD when every configured pool has had an alive instance for
  ``hysteresis_s`` without a break; targets revert to the assigned roles.

Invariants: the mode changes only here; ``missing_roles`` is fixed on entry, so an
instance that is draining for its switch to hybrid cannot widen the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PD, FALLBACK, COLOCATED = "PD", "FALLBACK", "COLOCATED"
POOL_ROLES = ("prefill", "decode")  # the PD pools; the hybrid pool is not judged here


@dataclass
class ModeState:
    mode: str = PD
    reason: str = ""
    missing_roles: list[str] = field(default_factory=list)
    has_been_complete: bool = False
    complete_since_s: float | None = None  # in FALLBACK: every pool alive since


@dataclass(frozen=True)
class FallbackSettings:
    policy: str = "hybrid"            # hybrid | queue | fail (queue/fail: mode only)
    hysteresis_s: float = 30.0
    startup_grace_s: float = 60.0
    configured_roles: tuple[str, ...] = POOL_ROLES  # PD pools with replicas > 0


def initial_mode(s: FallbackSettings) -> str:
    """The mode of a new cluster state: COLOCATED without PD pools, else PD."""
    return PD if s.configured_roles else COLOCATED


def evaluate(state: ModeState, num_alive: dict[str, int], now_s: float, started_s: float,
             s: FallbackSettings) -> str | None:
    """Update ``state`` from alive counts by assigned role. Returns an event line on a change."""
    if not s.configured_roles:
        if state.mode == COLOCATED:
            return None
        before = state.mode
        state.mode, state.reason, state.missing_roles = COLOCATED, "", []
        state.complete_since_s = None
        return f"mode {before} -> COLOCATED (no prefill or decode pool: hybrid instances serve)"
    if state.mode == COLOCATED:
        state.mode = PD  # the spec gained a PD pool (state from an earlier spec): judge it now
    missing = [r for r in POOL_ROLES if num_alive.get(r, 0) == 0]
    missing_configured = [r for r in missing if r in s.configured_roles]
    if not missing and set(s.configured_roles) == set(POOL_ROLES):
        state.has_been_complete = True
    if state.mode == PD:
        if not missing_configured and len(s.configured_roles) == len(POOL_ROLES):
            return None
        unconfigured = [r for r in POOL_ROLES if r not in s.configured_roles]
        may_enter = state.has_been_complete or now_s - started_s >= s.startup_grace_s
        if not unconfigured and not may_enter:
            return None
        state.mode, state.missing_roles = FALLBACK, missing_configured + unconfigured
        state.reason = "no ready " + " or ".join(state.missing_roles) + " instance"
        state.complete_since_s = None
        return f"mode PD -> FALLBACK ({state.reason}; policy {s.policy})"
    if missing or set(s.configured_roles) != set(POOL_ROLES):
        state.complete_since_s = None
        return None
    if state.complete_since_s is None:
        state.complete_since_s = now_s
    if now_s - state.complete_since_s < s.hysteresis_s:
        return None
    state.mode, state.reason, state.missing_roles = PD, "", []
    state.complete_since_s = None
    return f"mode FALLBACK -> PD (both pools ready for {s.hysteresis_s:g}s)"


def target_role(state: ModeState, assigned_role: str, s: FallbackSettings) -> str:
    """The role an instance should run now. Called by the Controller for each instance."""
    if state.mode == FALLBACK and s.policy == "hybrid" and assigned_role not in state.missing_roles:
        return "hybrid"
    return assigned_role
