"""The PDPools of a PDCluster: one scalable object per pool, so that an autoscaler
(HorizontalPodAutoscaler, KEDA) or ``kubectl scale`` can size one pool through the
``scale`` subresource (``pdserve.api.pool``). Reconcile reads them once a pass and
applies what the pure functions here return.

Ownership: the PDCluster stays the source of truth for every field. A PDPool's
``spec.replicas`` that differs from its ``status.observedClusterReplicas`` (the
PDCluster's replicas when the operator last synced the pool) is a scale request:
someone scaled the PDPool. ``sync_pool`` decides what becomes of it:

- written into the PDCluster's ``spec.<pool>.replicas`` when nobody else owns that
  field and the PDCluster's rules take the new size (``planner_follow.
  replicas_problems``, the validation the apiserver does);
- refused, and the PDPool set back to the PDCluster's size with a Warning Event,
  when the SLO planner owns the field (``spec.planner`` enabled and not advisory:
  the prefill and decode pools are its, as ``planner_follow.py`` says; the hybrid
  pool never is) or the PDCluster's rules refuse the size.

Anything else (the PDCluster changed, or nothing did) sets ``spec.replicas`` to the
PDCluster's size. Then ``observedClusterReplicas`` takes the PDCluster's size. When
both changed between two passes, the PDPool's scale wins: it is the later request as
far as the operator can tell, and an autoscaler repeats its own anyway.

Invariants: pure (no I/O); a PDPool is named ``<cluster>-<pool>`` and owned by its
PDCluster (the garbage collector removes it with the cluster); every pool has one,
whatever its replicas (KEDA may scale a pool up from zero); a pass writes a
PDPool's ``spec.replicas`` only with the ``resourceVersion`` it read, so a scale made
meanwhile is never overwritten (the write fails, the PDPool's event starts the next
pass, which reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.api import PDCluster
from pdserve.api.common import API_VERSION
from pdserve.api.instance import Pool
from pdserve.api.pool import pdpool_name
from pdserve.operator import builders as b
from pdserve.operator.planner_follow import is_following, replicas_problems

COMPONENT = "pool"
"""The component label of PDPools (the engine Pods they select are ``engine``)."""


@dataclass(frozen=True)
class PoolSync:
    """What one pass does with one PDPool."""

    pool: Pool
    cluster_replicas: int          # the PDCluster's spec.<pool>.replicas now
    asked: int | None = None       # a scale request (the PDPool's spec.replicas), None: none
    refused: str | None = None     # why ``asked`` is not written into the PDCluster

    @property
    def is_accepted(self) -> bool:
        """A request the PDCluster is to take."""
        return self.asked is not None and self.refused is None


def is_owned_by_planner(cluster: PDCluster, pool: Pool) -> bool:
    """Whether the SLO planner owns ``spec.<pool>.replicas`` (then a PDPool's scale is set back)."""
    return is_following(cluster) and pool in b.PD_POOLS


def replicas_of(cluster: PDCluster, pool: Pool) -> int:
    return getattr(cluster.spec, pool).replicas


def pool_selector_text(cluster: PDCluster, pool: Pool) -> str:
    """The label selector of ``pool``'s engine Pods, as the scale subresource carries it."""
    return ",".join(f"{k}={v}" for k, v in sorted(b.pool_selector(cluster, pool).items()))


def build_pdpool(cluster: PDCluster, pool: Pool) -> dict:
    """The PDPool of ``pool`` as the operator creates it: the PDCluster's size."""
    name = pdpool_name(cluster.metadata.name, pool)
    return {"apiVersion": API_VERSION, "kind": "PDPool",
            "metadata": b.metadata(cluster, name, COMPONENT, **{b.POOL_LABEL: pool}),
            "spec": {"cluster": cluster.metadata.name, "pool": pool,
                     "replicas": replicas_of(cluster, pool)}}


def build_pdpools(cluster: PDCluster) -> list[dict]:
    return [build_pdpool(cluster, pool) for pool in b.POOLS]


def sync_pool(cluster: PDCluster, pool: Pool, pdpool: dict | None) -> PoolSync:
    """The decision for ``pool`` (the module's rule). ``pdpool``: the object as read, None
    when it does not exist yet. Called by reconcile on every pass."""
    current = replicas_of(cluster, pool)
    if pdpool is None:
        return PoolSync(pool, current)
    asked = int((pdpool.get("spec") or {}).get("replicas", current))
    observed = (pdpool.get("status") or {}).get("observedClusterReplicas")
    # never synced (just created): its size was the PDCluster's; nothing was asked
    if observed is None or asked == int(observed) or asked == current:
        return PoolSync(pool, current)
    if is_owned_by_planner(cluster, pool):
        return PoolSync(pool, current, asked, f"the SLO planner owns spec.{pool}.replicas "
                                              "(spec.planner is enabled and not advisory)")
    problems = replicas_problems(cluster, {pool: asked})
    if problems:
        return PoolSync(pool, current, asked, "the PDCluster's rules refuse it: " + "; ".join(problems))
    return PoolSync(pool, current, asked)


def build_pdpool_status(cluster: PDCluster, pdpool: dict, pods: list[dict], num_ready: int) -> dict:
    """``status`` of ``pdpool`` after a pass: the pool's engine Pods (of ``pods``, the
    cluster's) not terminating, ``num_ready`` serving (the PDCluster's ``status.ready<Pool>``),
    the selector, and ``observedClusterReplicas`` where ``spec.replicas`` holds the
    PDCluster's size (a request still pending keeps the old value, so it stays one)."""
    pool = pdpool["spec"]["pool"]
    current = replicas_of(cluster, pool)
    num_pods = sum(p["metadata"].get("labels", {}).get(b.POOL_LABEL) == pool
                   and not p["metadata"].get("deletionTimestamp") for p in pods)
    status = {"replicas": num_pods, "readyReplicas": num_ready, "selector": pool_selector_text(cluster, pool)}
    if pdpool["spec"].get("replicas") == current:
        status["observedClusterReplicas"] = current
    return status


def describe_scale(cluster: PDCluster, sync: PoolSync) -> str:
    """The message of the Normal Event posted on the PDCluster once it took a request."""
    name = pdpool_name(cluster.metadata.name, sync.pool)
    return f"spec.{sync.pool}.replicas {sync.cluster_replicas} -> {sync.asked} (PDPool {name} was scaled)"


def describe_refusal(sync: PoolSync) -> str:
    """The message of the Warning Event posted on the PDPool whose request was refused."""
    return (f"scale to {sync.asked} refused: {sync.refused}; spec.replicas is set back to "
            f"{sync.cluster_replicas}, the PDCluster's spec.{sync.pool}.replicas")
