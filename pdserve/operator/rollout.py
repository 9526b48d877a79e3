"""Which engine Pods a settings rollout replaces now: a pure decision, one call per
reconcile pass (``Reconciler._apply_engine_pods`` deletes what it returns; the next
passes create the new Pods from the current settings).

Algorithm, per pool, over the Pods of the instances the spec wants:

1. A stale Pod (old settings hash) that does not serve is replaced at once: it
   serves nothing, so replacing it costs nothing.
2. A pool gives up one stale serving Pod only when it is *settled*: every desired
   instance has a Pod, each serves, none is terminating. So a pool of n keeps n - 1
   serving while one Pod is replaced, and the next goes only after the new Pod
   became Ready.
3. A pool's last serving Pod goes only while every other pool with replicas keeps
   a serving Pod: a cluster never loses its last prefill and its last decode engine
   together (a pool of one is necessarily empty while its Pod is replaced; requests
   meanwhile run as the fallback policy says).

"Serving": the Pod is Ready (the agent's /readyz: engine answers, KV registered), not
terminating, and its PDInstance is not Suspect or Failed.

Thresholds: one Pod per pool at a time (the pools' PodDisruptionBudgets say the same
to node drains). Pairing safety while two settings run: the Coordinator pairs only
engines with equal KV compatibility hashes, and the KV handshake refuses the rest.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnginePod:
    """One desired instance's Pod as the rollout sees it."""

    name: str
    pool: str
    ordinal: int
    is_current: bool   # carries the pool's current settings hash
    is_serving: bool
    is_terminating: bool


def choose_replacements(pods: list[EnginePod], desired: dict[str, int]) -> list[str]:
    """Names of the Pods to delete now. ``desired``: pool -> replicas the spec asks for;
    ``pods``: the Pods of those instances (a missing Pod is simply absent)."""
    chosen = [p.name for p in pods if not p.is_current and not p.is_serving and not p.is_terminating]
    serving = {pool: sum(p.is_serving for p in pods if p.pool == pool) for pool in desired}
    for pool, num_desired in desired.items():
        mine = [p for p in pods if p.pool == pool]
        stale = sorted((p for p in mine if not p.is_current and p.is_serving), key=lambda p: p.ordinal)
        is_settled = (len(mine) == num_desired == serving[pool]
                      and not any(p.is_terminating for p in mine))
        if not stale or not is_settled:
            continue
        others_serve = all(serving[o] > 0 for o, n in desired.items() if o != pool and n > 0)
        if serving[pool] == 1 and not others_serve:
            continue
        chosen.append(stale[0].name)
        serving[pool] -= 1
    return chosen
