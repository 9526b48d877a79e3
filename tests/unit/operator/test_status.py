"""Status is a pure function of what reconcile observed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from pdserve.operator import builders as b
from pdserve.operator.controller_client import RoutableInstance
from pdserve.operator.status import (
    HEARTBEAT_WRITE_PERIOD_S,
    Observation,
    build_instance_status,
    build_invalid_status,
    build_status,
    instance_phase,
)
from tests.unit.operator.test_builders import cluster, colocated, engine_hashes

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def pod(c, name: str, phase: str | None = "Running", ready: bool = True, spec_hash: str | None = None) -> dict:
    pool = b.desired_instances(c)[name][0] if name in b.desired_instances(c) else "prefill"
    labels = {b.SPEC_HASH_LABEL: spec_hash or engine_hashes(c)[pool]}
    status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return {"metadata": {"name": name, "labels": labels}, "status": status if phase else {}}


def slice_of(*endpoints: dict) -> dict:
    """An EndpointSlice of the Coordinator Service holding ``endpoints``."""
    return {"addressType": "IPv4", "endpoints": list(endpoints), "ports": [{"name": "http", "port": 8000}]}


ROUTED = [slice_of({"addresses": ["10.0.0.9"], "conditions": {"ready": True}})]


def observed(c, **overrides) -> Observation:
    names = b.desired_instances(c)
    obs = Observation(
        instances={n: b.build_instance(c, pool, i) for n, (pool, i) in names.items()},
        pods={n: pod(c, n) for n in names},
        deployments={k: {"status": {"availableReplicas": 1}} for k in ("controller", "coordinator")},
        coordinator_slices=ROUTED,
        pod_hashes=engine_hashes(c))
    for key, value in overrides.items():
        setattr(obs, key, value)
    return obs


def conditions(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_all_ready_is_ready_and_not_progressing():
    c = cluster()
    status = build_status(c, 3, None, observed(c), NOW)
    assert conditions(status) == {"Ready": ("True", "AllInstancesReady"),
                                  "Progressing": ("False", "Reconciled"),
                                  "Degraded": ("False", "AsExpected"),
                                  "HybridFallback": ("False", "PoolsServing")}
    assert (status["readyPrefill"], status["readyDecode"], status["mode"]) == (2, 1, "PD")
    assert status["observedGeneration"] == 3
    assert all(cond["observedGeneration"] == 3 for cond in status["conditions"])


def test_same_observation_later_keeps_transition_times():
    c = cluster()
    first = build_status(c, 3, None, observed(c), NOW)
    again = build_status(c, 3, first, observed(c), NOW + timedelta(minutes=5))
    assert again == first


def test_pending_pods_and_missing_control_plane_are_progressing():
    c = cluster()
    obs = observed(c)
    obs.pods["c-decode-0"] = pod(c, "c-decode-0", phase="Pending", ready=False)
    status = build_status(c, 1, None, obs, NOW)
    assert conditions(status)["Ready"] == ("False", "NotReady")
    assert conditions(status)["Progressing"] == ("True", "WaitingForInstances")
    assert "decode 0/1 ready" in next(x["message"] for x in status["conditions"] if x["type"] == "Ready")
    obs = observed(c, deployments={"controller": None, "coordinator": None})
    assert conditions(build_status(c, 1, None, obs, NOW))["Progressing"] == ("True", "WaitingForControlPlane")


def test_not_ready_until_the_coordinator_service_routes_to_a_pod():
    """The Deployment counts its Pod available before the endpoints controller adds the
    Pod to the Service: a client that waited for Ready would meet a Service with
    nowhere to send it."""
    c = cluster()
    not_ready = {"addresses": ["10.0.0.9"], "conditions": {"ready": False, "serving": True,
                                                            "terminating": True}}
    for slices in ([], [slice_of()], [slice_of(not_ready)], [slice_of({"addresses": [],
                                                                     "conditions": {"ready": True}})]):
        status = build_status(c, 1, None, observed(c, coordinator_slices=slices), NOW)
        assert conditions(status)["Ready"] == ("False", "NotReady")
        assert conditions(status)["Progressing"] == ("True", "WaitingForControlPlane")
        assert "routes to no ready Pod" in next(x["message"] for x in status["conditions"]
                                                if x["type"] == "Progressing")
    assert conditions(build_status(c, 1, None, observed(c), NOW))["Ready"] == ("True", "AllInstancesReady")
    # One ready endpoint in any slice is a route; no ``ready`` condition reads as ready
    # (the API's advice for an unknown state).
    for slices in ([slice_of(not_ready), slice_of({"addresses": ["10.0.0.8"]})],
                   [slice_of(not_ready, {"addresses": ["10.0.0.8"], "conditions": {"ready": True}})]):
        status = build_status(c, 1, None, observed(c, coordinator_slices=slices), NOW)
        assert conditions(status)["Ready"] == ("True", "AllInstancesReady")


def test_old_settings_pods_mean_rolling_and_not_ready():
    c = cluster()
    obs = observed(c, num_stale_pods=1)
    obs.pods["c-prefill-0"] = pod(c, "c-prefill-0", spec_hash="old")
    status = build_status(c, 2, None, obs, NOW)
    assert conditions(status)["Progressing"] == ("True", "RollingEngines")
    assert status["readyPrefill"] == 1


def test_failed_pod_is_degraded_and_an_empty_pool_is_hybrid_fallback():
    c = cluster()
    obs = observed(c)
    obs.pods["c-decode-0"] = pod(c, "c-decode-0", phase="Failed", ready=False)
    status = build_status(c, 1, None, obs, NOW)
    assert conditions(status)["Degraded"] == ("True", "PodFailed")
    assert conditions(status)["HybridFallback"] == ("True", "PoolEmpty")
    assert status["mode"] == "Fallback"
    assert conditions(build_status(c, 1, None, observed(c, controller_mode="FALLBACK"), NOW))[
        "HybridFallback"] == ("True", "ControllerFallback")


def test_draining_instances_do_not_count_and_are_terminating():
    c = cluster()
    obs = observed(c, draining=["c-prefill-1"])
    status = build_status(c, 1, None, obs, NOW)
    assert conditions(status)["Progressing"] == ("True", "ScalingDown")
    assert instance_phase(obs.pods["c-prefill-1"], is_draining=True) == "Terminating"
    assert instance_phase(None, is_draining=False) == "Pending"
    assert instance_phase(pod(c, "x", phase="Failed"), is_draining=False) == "Failed"


def test_invalid_spec_status_says_why():
    status = build_invalid_status(4, None, "spec.model: set exactly one of preset, path, pvc, image", NOW)
    conds = {x["type"]: x for x in status["conditions"]}
    assert conds["Ready"]["status"] == "False" and conds["Degraded"]["status"] == "True"
    assert conds["Degraded"]["reason"] == "InvalidSpec"
    assert "spec.model" in conds["Ready"]["message"] and status["observedGeneration"] == 4


def test_a_colocated_cluster_is_ready_in_colocated_mode_not_fallback():
    c = colocated()
    status = build_status(c, 1, None, observed(c), NOW)
    assert conditions(status) == {"Ready": ("True", "AllInstancesReady"),
                                  "Progressing": ("False", "Reconciled"),
                                  "Degraded": ("False", "AsExpected"),
                                  "HybridFallback": ("False", "Colocated")}
    assert status["mode"] == "Colocated"
    assert (status["desiredHybrid"], status["readyHybrid"]) == (2, 2)
    assert (status["desiredPrefill"], status["readyPrefill"]) == (0, 0)
    ready = next(x["message"] for x in status["conditions"] if x["type"] == "Ready")
    assert ready == "prefill 0/0 ready, decode 0/0 ready, hybrid 2/2 ready"
    with_controller = build_status(c, 1, None, observed(c, controller_mode="COLOCATED"), NOW)
    assert conditions(with_controller)["HybridFallback"] == ("False", "ControllerColocated")
    assert with_controller["mode"] == "Colocated"


def test_a_hybrid_engine_not_ready_yet_is_progressing():
    c = colocated()
    obs = observed(c)
    obs.pods["c-hybrid-1"] = pod(c, "c-hybrid-1", phase="Pending", ready=False)
    status = build_status(c, 1, None, obs, NOW)
    assert conditions(status)["Progressing"] == ("True", "WaitingForInstances")
    assert status["readyHybrid"] == 1 and status["mode"] == "Colocated"
    assert conditions(status)["HybridFallback"] == ("False", "Colocated")


def test_a_pd_cluster_with_a_hybrid_pool_counts_it():
    c = cluster(hybrid={"replicas": 1})
    status = build_status(c, 1, None, observed(c), NOW)
    assert status["mode"] == "PD" and status["readyHybrid"] == 1 and status["desiredHybrid"] == 1
    assert conditions(status)["HybridFallback"] == ("False", "PoolsServing")


# --- PDInstance status from the Pod and the Controller's view ----------------------

THRESHOLDS = (3.0, 10.0)  # out of the view: Suspect after, Failed after (seconds)


def routable(name: str, role: str, at: datetime = NOW) -> dict[str, RoutableInstance]:
    return {name: RoutableInstance(role, at.timestamp())}


def instance_status(old: dict | None, pod_: dict | None, view, now: datetime = NOW) -> dict:
    return build_instance_status("c-decode-0", old, pod_, False, view, THRESHOLDS, 1, now)


def ready_condition(status: dict) -> tuple[str, str, str]:
    [ready] = status["conditions"]
    return ready["status"], ready["reason"], ready["lastTransitionTime"]


def test_an_instance_in_the_routable_view_is_ready_with_its_role_and_heartbeat():
    c = cluster()
    running = pod(c, "c-decode-0")
    status = instance_status(None, running, routable("c-decode-0", "prefill"))
    assert {k: v for k, v in status.items() if k != "conditions"} == {
        "phase": "Running", "pod": "c-decode-0", "health": "Ready", "role": "prefill",
        "lastHeartbeat": "2026-01-01T00:00:00Z"}
    assert ready_condition(status) == ("True", "InControllerView", "2026-01-01T00:00:00Z")
    # the heartbeat is rewritten only every HEARTBEAT_WRITE_PERIOD_S (each write is an event)
    soon = NOW + timedelta(seconds=HEARTBEAT_WRITE_PERIOD_S - 1)
    assert instance_status(status, running, routable("c-decode-0", "prefill", soon), soon) == status
    later = NOW + timedelta(seconds=HEARTBEAT_WRITE_PERIOD_S)
    assert instance_status(status, running, routable("c-decode-0", "prefill", later), later)[
        "lastHeartbeat"] == "2026-01-01T00:00:30Z"


def test_out_of_the_view_is_suspect_then_failed_as_the_controller_counts():
    c = cluster()
    running = pod(c, "c-decode-0")
    ready = instance_status(None, running, routable("c-decode-0", "decode"))
    gone = instance_status(ready, running, {}, NOW + timedelta(seconds=1))
    assert gone["health"] == "Ready"  # a missed view (a Controller restarting) is no failure
    assert ready_condition(gone) == ("False", "NotInControllerView", "2026-01-01T00:00:01Z")
    suspect = instance_status(gone, running, {}, NOW + timedelta(seconds=4))
    assert (suspect["health"], suspect["role"], suspect["lastHeartbeat"]) == (
        "Suspect", "decode", ready["lastHeartbeat"])
    failed = instance_status(suspect, running, {}, NOW + timedelta(seconds=11))
    assert failed["health"] == "Failed"
    back = instance_status(failed, running, routable("c-decode-0", "decode"), NOW + timedelta(seconds=12))
    assert back["health"] == "Ready" and ready_condition(back)[0] == "True"


def test_a_new_pod_starts_again_and_a_failed_pod_is_failed():
    c = cluster()
    ready = instance_status(None, pod(c, "c-decode-0"), routable("c-decode-0", "decode"))
    assert instance_status(ready, None, {})["health"] == "Starting"  # deleted: a new Pod comes
    pending = instance_status(ready, pod(c, "c-decode-0", phase=None), None)
    assert pending["health"] == "Starting" and ready_condition(pending)[:2] == ("False", "PodNotRunning")
    # running, never seen Ready yet (loading weights): still starting, not suspect
    later = NOW + timedelta(minutes=5)
    assert instance_status(pending, pod(c, "c-decode-0"), {}, later)["health"] == "Starting"
    assert instance_status(ready, pod(c, "c-decode-0", phase="Failed"), None)["health"] == "Failed"


def test_without_the_controller_health_role_and_heartbeat_stay():
    c = cluster()
    ready = instance_status(None, pod(c, "c-decode-0"), routable("c-decode-0", "decode"))
    later = NOW + timedelta(hours=1)
    assert instance_status(ready, pod(c, "c-decode-0"), None, later) == ready


def test_an_unhealthy_instance_degrades_the_cluster_and_does_not_count():
    c = cluster()
    obs = observed(c)
    running = obs.pods["c-decode-0"]
    ready = instance_status(None, running, routable("c-decode-0", "decode"))
    gone = instance_status(ready, running, {})
    obs.instances["c-decode-0"]["status"] = instance_status(gone, running, {}, NOW + timedelta(seconds=5))
    status = build_status(c, 1, None, obs, NOW)
    assert conditions(status)["Degraded"] == ("True", "InstanceUnhealthy")
    assert status["readyDecode"] == 0
