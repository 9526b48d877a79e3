"""Pure status: a PDCluster's conditions and counts, and a PDInstance's phase,
computed from what reconcile observed (Pods, PDInstances, Deployments).

Owns the meaning of each condition:

- Ready: every desired instance's Pod runs the current engine settings and is
  Ready, and the Controller and Coordinator have an available replica.
- Progressing: the operator still has work (instances to create, Pods to roll,
  instances draining, Pods not Ready yet).
- Degraded: something failed (a Pod failed, an instance unhealthy or replaced,
  an invalid spec).
- HybridFallback: the Controller runs requests hybrid (its view says FALLBACK;
  without the Controller: a configured pool has no ready instance, the other has).
  Never for a colocated cluster (no prefill or decode replicas, only hybrid ones):
  its engines run whole requests by design, and ``mode`` says Colocated.

Invariants: no clock read and no I/O (``now`` is passed in); conditions go through
``set_condition``, so an unchanged observation leaves ``lastTransitionTime`` alone
and reconciling twice writes the same status.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from pdserve.api import PDCluster
from pdserve.api.conditions import Condition, set_condition
from pdserve.operator import builders as b


@dataclass
class Observation:
    """What one reconcile saw and did; filled by reconcile, read by ``build_status``."""

    instances: dict[str, dict] = field(default_factory=dict)   # name -> PDInstance
    pods: dict[str, dict] = field(default_factory=dict)        # name -> engine Pod
    deployments: dict[str, dict | None] = field(default_factory=dict)  # component -> Deployment
    num_stale_pods: int = 0
    draining: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    controller_mode: str | None = None


def is_pod_ready(pod: dict | None, spec_hash: str) -> bool:
    if pod is None or pod["metadata"].get("deletionTimestamp"):
        return False
    if pod["metadata"].get("labels", {}).get(b.SPEC_HASH_LABEL) != spec_hash:
        return False
    status = pod.get("status") or {}
    ready = [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    return status.get("phase") == "Running" and bool(ready) and ready[0].get("status") == "True"


def instance_phase(pod: dict | None, is_draining: bool) -> str:
    """PDInstance ``status.phase`` from its Pod."""
    if is_draining or (pod is not None and pod["metadata"].get("deletionTimestamp")):
        return "Terminating"
    phase = ((pod or {}).get("status") or {}).get("phase")
    if phase in ("Failed", "Succeeded"):
        return "Failed"
    return "Running" if phase == "Running" else "Pending"


def is_available(deployment: dict | None) -> bool:
    return bool(deployment and (deployment.get("status") or {}).get("availableReplicas", 0) >= 1)


def parse_conditions(status: dict | None) -> list[Condition]:
    return [Condition.model_validate(c) for c in (status or {}).get("conditions") or []]


def _ready_counts(cluster: PDCluster, obs: Observation) -> dict[str, int]:
    spec_hash = b.engine_spec_hash(cluster)
    counts = {"prefill": 0, "decode": 0, "hybrid": 0}
    for name, inst in obs.instances.items():
        health = (inst.get("status") or {}).get("health")
        if name in obs.draining or health in ("Failed", "Suspect"):
            continue
        if is_pod_ready(obs.pods.get(name), spec_hash):
            counts[inst["spec"]["role"]] += 1
    return counts


def _progress(cluster: PDCluster, obs: Observation, counts: dict[str, int]) -> tuple[str, str] | None:
    desired = b.desired_instances(cluster)
    missing = [n for n in desired if n not in obs.instances or n not in obs.pods]
    if obs.num_stale_pods:
        return "RollingEngines", f"{obs.num_stale_pods} Pods with old engine settings are replaced"
    if obs.draining:
        return "ScalingDown", "draining " + ", ".join(sorted(obs.draining))
    if missing:
        return "CreatingInstances", "waiting for " + ", ".join(sorted(missing))
    if sum(counts.values()) < len(desired):
        return "WaitingForInstances", f"{sum(counts.values())}/{len(desired)} instances ready"
    if not all(is_available(obs.deployments.get(c)) for c in ("controller", "coordinator")):
        return "WaitingForControlPlane", "Controller or Coordinator has no available replica"
    return None


def _degraded(obs: Observation) -> tuple[str, str] | None:
    failed = sorted(n for n, p in obs.pods.items() if (p.get("status") or {}).get("phase") == "Failed")
    if failed:
        return "PodFailed", "failed Pods: " + ", ".join(failed)
    if obs.replaced:
        return "InstanceReplaced", "replaced after repeated failures: " + ", ".join(sorted(obs.replaced))
    unhealthy = sorted(n for n, i in obs.instances.items()
                       if (i.get("status") or {}).get("health") in ("Failed", "Suspect"))
    if unhealthy:
        return "InstanceUnhealthy", "unhealthy: " + ", ".join(unhealthy)
    return None


def is_colocated(cluster: PDCluster) -> bool:
    """No prefill or decode replicas: the hybrid pool serves everything (not a fallback)."""
    return not any(getattr(cluster.spec, p).replicas for p in b.PD_POOLS)


_CONTROLLER_MODE_REASONS = {"FALLBACK": "ControllerFallback", "PD": "ControllerPD",
                            "COLOCATED": "ControllerColocated"}


def _fallback(cluster: PDCluster, obs: Observation, counts: dict[str, int]) -> tuple[bool, str, str]:
    if obs.controller_mode is not None:
        on = obs.controller_mode == "FALLBACK"
        reason = _CONTROLLER_MODE_REASONS.get(obs.controller_mode, "ControllerPD")
        return on, reason, f"Controller mode {obs.controller_mode}"
    configured = [p for p in b.PD_POOLS if getattr(cluster.spec, p).replicas > 0]
    empty = [p for p in configured if counts[p] == 0]
    serving = sum(counts.values()) > 0
    if cluster.spec.fallback.policy == "hybrid" and empty and serving:
        return True, "PoolEmpty", f"no ready {' or '.join(empty)} instance: requests run hybrid"
    if not serving:
        return False, "NoInstancesReady", ""
    return False, "Colocated" if is_colocated(cluster) else "PoolsServing", ""


def build_status(cluster: PDCluster, generation: int | None, old: dict | None, obs: Observation,
                 now: datetime) -> dict:
    """The ``status`` to write for ``cluster``. Called by reconcile after applying."""
    counts = _ready_counts(cluster, obs)
    progress, degraded = _progress(cluster, obs, counts), _degraded(obs)
    fallback_on, fallback_reason, fallback_message = _fallback(cluster, obs, counts)
    desired = {p: getattr(cluster.spec, p).replicas for p in b.POOLS}
    shown = [p for p in b.POOLS if p in b.PD_POOLS or desired[p] or counts[p]]
    ready_msg = ", ".join(f"{p} {counts[p]}/{desired[p]} ready" for p in shown)
    conditions = parse_conditions(old)
    for type_, is_true, reason, message in (
        ("Ready", progress is None, "AllInstancesReady" if progress is None else "NotReady", ready_msg),
        ("Progressing", progress is not None, *(progress or ("Reconciled", "spec applied"))),
        ("Degraded", degraded is not None, *(degraded or ("AsExpected", ""))),
        ("HybridFallback", fallback_on, fallback_reason, fallback_message),
    ):
        conditions = set_condition(conditions, type_, "True" if is_true else "False", reason,
                                   message, generation, now)
    mode = "Fallback" if fallback_on else "Colocated" if is_colocated(cluster) else "PD"
    return {
        "observedGeneration": generation,
        "mode": mode,
        "conditions": [c.to_manifest() for c in conditions],
        "desiredPrefill": desired["prefill"], "desiredDecode": desired["decode"],
        "desiredHybrid": desired["hybrid"],
        "readyPrefill": counts["prefill"], "readyDecode": counts["decode"],
        "readyHybrid": counts["hybrid"],
        "coordinatorUrl": f"http://{cluster.metadata.name}-coordinator."
                          f"{cluster.metadata.namespace}.svc:{b.COORDINATOR_PORT}",
    }


def build_invalid_status(generation: int | None, old: dict | None, message: str,
                         now: datetime) -> dict:
    """Status for a spec the operator refuses: Ready False and Degraded True, saying why."""
    conditions = parse_conditions(old)
    for type_, is_true, reason in (("Ready", False, "InvalidSpec"), ("Progressing", False, "InvalidSpec"),
                                   ("Degraded", True, "InvalidSpec")):
        conditions = set_condition(conditions, type_, "True" if is_true else "False", reason,
                                   message, generation, now)
    return {**(old or {}), "observedGeneration": generation,
            "conditions": [c.to_manifest() for c in conditions]}
