"""Pure status: a PDCluster's conditions and counts, and a PDInstance's status
(phase, pod, health, last heartbeat, current role), computed from what reconcile
observed (Pods, PDInstances, Deployments, the Controller's view).

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
- Doctor: set by reconcile after ``build_status``, from the doctor's background
  checks (``doctor.py`` owns its meaning).
- Planner: set by reconcile after ``build_status``, from the SLO planner's view
  (``planner_follow.py`` owns its meaning, and ``status.planner``).

A PDInstance's health (``build_instance_status``): the Controller's view lists its
READY instances only, so the operator reads them as ``Ready`` (with their role and
last heartbeat) and infers the rest from the instance's ``Ready`` condition (True
while it is in the view; its ``lastTransitionTime`` says since when it is out): a
Pod not running yet is ``Starting``, a failed Pod ``Failed``; an instance that was
Ready and has been out of the view for ``suspectAfterMissed`` heartbeat intervals is
``Suspect``, for ``failedAfterMissed`` intervals ``Failed`` (the Controller's
thresholds, counted from the pass that first missed it); one never seen Ready stays
``Starting``. Without an answer from the Controller, health, role, heartbeat and the
condition keep their last values. (An instance draining for a role switch also
leaves the view, and reads Suspect if the switch outlasts the Suspect threshold.)

Invariants: no clock read and no I/O (``now`` is passed in); conditions go through
``set_condition``, so an unchanged observation leaves ``lastTransitionTime`` alone
and reconciling twice writes the same status; ``lastHeartbeat`` is rewritten at most
every ``HEARTBEAT_WRITE_PERIOD_S`` while nothing else changes (each write is an
event that triggers a pass: writing every heartbeat would reconcile in a loop).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from pdserve.api import PDCluster
from pdserve.api.conditions import Condition, get_condition, set_condition
from pdserve.operator import builders as b

if TYPE_CHECKING:
    from pdserve.operator.controller_client import RoutableInstance

HEARTBEAT_WRITE_PERIOD_S = 30.0


@dataclass
class Observation:
    """What one reconcile saw and did; filled by reconcile, read by ``build_status``."""

    instances: dict[str, dict] = field(default_factory=dict)   # name -> PDInstance
    pods: dict[str, dict] = field(default_factory=dict)        # name -> engine Pod
    deployments: dict[str, dict | None] = field(default_factory=dict)  # component -> Deployment
    coordinator_slices: list[dict] = field(default_factory=list)  # its Service's EndpointSlices
    pod_hashes: dict[str, str] = field(default_factory=dict)   # pool -> current settings hash
    num_stale_pods: int = 0
    draining: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    controller_mode: str | None = None


def is_pod_serving(pod: dict | None) -> bool:
    """Running, Ready and not terminating, whatever its settings."""
    if pod is None or pod["metadata"].get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    ready = [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    return status.get("phase") == "Running" and bool(ready) and ready[0].get("status") == "True"


def is_pod_ready(pod: dict | None, spec_hash: str | None) -> bool:
    """Serving, with the current settings ``spec_hash``."""
    return is_pod_serving(pod) and pod["metadata"].get("labels", {}).get(b.SPEC_HASH_LABEL) == spec_hash


def is_unhealthy(instance: dict) -> bool:
    return (instance.get("status") or {}).get("health") in ("Failed", "Suspect")


def instance_phase(pod: dict | None, is_draining: bool) -> str:
    """PDInstance ``status.phase`` from its Pod."""
    if is_draining or (pod is not None and pod["metadata"].get("deletionTimestamp")):
        return "Terminating"
    phase = ((pod or {}).get("status") or {}).get("phase")
    if phase in ("Failed", "Succeeded"):
        return "Failed"
    return "Running" if phase == "Running" else "Pending"


def rfc3339(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _seconds_since(stamp: str | None, now: datetime) -> float:
    """Seconds from RFC 3339 ``stamp`` to ``now``; infinite without a stamp."""
    if not stamp:
        return float("inf")
    return (now - datetime.fromisoformat(stamp.replace("Z", "+00:00"))).total_seconds()


def build_instance_status(name: str, old: dict | None, pod: dict | None, is_draining: bool,
                          routable: Mapping[str, RoutableInstance] | None,
                          thresholds: tuple[float, float], generation: int | None,
                          now: datetime) -> dict:
    """The ``status`` of PDInstance ``name`` (keys with None are removed by the merge
    patch). ``routable``: the Controller's routable view, None when it did not answer;
    ``thresholds``: seconds out of the view before Suspect and before Failed (the
    heartbeat interval times ``suspectAfterMissed``, ``failedAfterMissed``). Called by
    reconcile for every instance on every pass; the rules are the module's."""
    old = old or {}
    phase = instance_phase(pod, is_draining)
    health, role, beat = old.get("health"), old.get("role"), old.get("lastHeartbeat")
    conditions = parse_conditions(old)
    routed = ("False", "PodNotRunning", f"the Pod is {phase}")
    if phase == "Pending":
        health = "Starting"
    elif phase == "Failed":
        health = "Failed"
    if phase == "Running" and routable is not None:
        seen = routable.get(name)
        if seen is not None:
            heard = datetime.fromtimestamp(seen.last_heartbeat_unix_s, UTC)
            if (health != "Ready" or role != seen.role
                    or _seconds_since(beat, heard) >= HEARTBEAT_WRITE_PERIOD_S):
                beat = rfc3339(seen.last_heartbeat_unix_s)
            health, role = "Ready", seen.role or role
            routed = ("True", "InControllerView", "the Controller routes requests to it")
        else:
            routed = ("False", "NotInControllerView", "not in the Controller's routable view")
    if phase != "Running" or routable is not None:
        conditions = set_condition(conditions, "Ready", *routed, generation, now)
    ready = get_condition(conditions, "Ready")
    if phase == "Running" and routable is not None and routed[0] == "False":
        out_s = (now - ready.last_transition_time).total_seconds()
        suspect_after_s, failed_after_s = thresholds
        if health in ("Ready", "Suspect"):  # seen Ready since its Pod started
            health = ("Failed" if out_s >= failed_after_s else
                      "Suspect" if out_s >= suspect_after_s else health)
        elif health != "Failed":
            health = "Starting"
    return {"phase": phase, "pod": name if pod else None, "health": health, "role": role,
            "lastHeartbeat": beat, "conditions": [c.to_manifest() for c in conditions]}


def is_available(deployment: dict | None) -> bool:
    return bool(deployment and (deployment.get("status") or {}).get("availableReplicas", 0) >= 1)


def has_ready_endpoint(slices: list[dict]) -> bool:
    """Whether a Service's EndpointSlices list a ready endpoint with an address (one the
    Service routes to). An endpoint without ``conditions.ready`` counts as ready, as
    the API says consumers should read an unknown state."""
    return any(endpoint.get("addresses") and (endpoint.get("conditions") or {}).get("ready") is not False
               for s in slices for endpoint in s.get("endpoints") or [])


def parse_conditions(status: dict | None) -> list[Condition]:
    return [Condition.model_validate(c) for c in (status or {}).get("conditions") or []]


def _ready_counts(obs: Observation) -> dict[str, int]:
    counts = {"prefill": 0, "decode": 0, "hybrid": 0}
    for name, inst in obs.instances.items():
        if name in obs.draining or is_unhealthy(inst):
            continue
        pool = inst["spec"]["pool"]
        if is_pod_ready(obs.pods.get(name), obs.pod_hashes.get(pool)):
            counts[pool] += 1
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
    if not has_ready_endpoint(obs.coordinator_slices):
        # A Pod counts as available before the Service routes to it: Ready waits for the
        # route, so a client that waited for Ready reaches a Coordinator.
        return "WaitingForControlPlane", "the Coordinator's Service routes to no ready Pod yet"
    return None


def _degraded(obs: Observation) -> tuple[str, str] | None:
    failed = sorted(n for n, p in obs.pods.items() if (p.get("status") or {}).get("phase") == "Failed")
    if failed:
        return "PodFailed", "failed Pods: " + ", ".join(failed)
    if obs.replaced:
        return "InstanceReplaced", "replaced after repeated failures: " + ", ".join(sorted(obs.replaced))
    unhealthy = sorted(n for n, i in obs.instances.items() if is_unhealthy(i))
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
    counts = _ready_counts(obs)
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
        "coordinatorUrl": f"http://{b.coordinator_service_name(cluster)}."
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
