"""The operator follows the SLO planner: the Controller's planner view becomes a patch
of the PDCluster's two replicas fields (within spec.planner's bounds, and only what
the spec's rules accept), ``status.planner``, the ``Planner`` condition and one Event
per action. First the pure mapping, then whole reconcile passes against an in-memory
API and a scripted Controller: patch, drain, delete, report, and a hand edit undone."""

from __future__ import annotations

import copy
import itertools
from datetime import UTC, datetime

import pytest
import pytest_asyncio

from pdserve.api.proto import controller_pb2 as pb
from pdserve.operator import builders as b
from pdserve.operator.controller_client import ControllerView, DrainState
from pdserve.operator.doctor import DoctorRuns
from pdserve.operator.kube import KubeClient, KubeError, is_subset, path
from pdserve.operator.planner_follow import (
    apply_planner_status,
    build_planner_status,
    plan_replicas,
    planner_event,
)
from pdserve.operator.reconcile import Reconciler
from pdserve.operator.settings import OperatorSettings
from tests.kmock_emulator import merge_patch
from tests.unit.operator.test_builders import cluster

NOW = datetime(2026, 1, 1, tzinfo=UTC)
PLANNER = {"enabled": True, "intervalSeconds": 1, "stableIntervals": 2, "cooldownSeconds": 0}
SHRINK = "want 1 P + 1 D, have 2 P + 1 D: the load fits on 1 prefill engine(s)"
BALANCED = "want 1 P + 1 D, have 1 P + 1 D: balanced"


def planned(**planner):
    """The default test cluster (2 prefill, 1 decode) with the planner on."""
    return cluster(planner={**PLANNER, **planner})


def view(prefill: int = 1, decode: int = 1, reason: str = SHRINK, num_actions: int = 1,
         last_action: str = "remove one prefill engine", **fields) -> pb.PlannerView:
    return pb.PlannerView(replicas_prefill=prefill, replicas_decode=decode, wanted_prefill=1, wanted_decode=1,
                          reason=reason, is_balanced=reason == BALANCED, num_actions=num_actions,
                          last_action=last_action,
                          last_action_unix_s=1767225600.0 if num_actions else 0.0, **fields)


def planner_condition(status: dict) -> tuple[str, str, str] | None:
    found = [c for c in status["conditions"] if c["type"] == "Planner"]
    return (found[0]["status"], found[0]["reason"], found[0]["message"]) if found else None


# --- the mapping ------------------------------------------------------------------

def test_the_planners_pool_sizes_become_a_patch_of_the_spec_replicas():
    plan = plan_replicas(planned(), view(prefill=1, decode=1))
    assert plan.patch == {"spec": {"prefill": {"replicas": 1}}} and not plan.refused
    assert plan.replicas == {"prefill": 1, "decode": 1} and plan.notes == ()
    plan = plan_replicas(planned(), view(prefill=3, decode=2))
    assert plan.patch == {"spec": {"prefill": {"replicas": 3}, "decode": {"replicas": 2}}}
    # the spec already holds them: nothing to write
    assert plan_replicas(planned(), view(prefill=2, decode=1)).patch is None


def test_nothing_is_followed_with_the_planner_off_advisory_or_not_running():
    assert plan_replicas(cluster(), view()) is None                          # spec.planner off
    assert plan_replicas(planned(advisory=True), view()) is None             # the spec says advisory
    assert plan_replicas(planned(), view(advisory=True)) is None             # the Controller's planner is
    assert plan_replicas(planned(), None) is None                            # no planner in the view


def test_sizes_stay_within_the_planners_bounds_never_below_its_minimum():
    # the planner counts an engine it asked to remove until it drains, and asks again
    plan = plan_replicas(planned(minPrefill=1, maxDecode=4), view(prefill=0, decode=9))
    assert plan.replicas == {"prefill": 1, "decode": 4}
    assert plan.patch == {"spec": {"prefill": {"replicas": 1}, "decode": {"replicas": 4}}}
    assert plan.notes == ("the planner asks for 0 prefill; kept at 1 (spec.planner allows 1 to 8)",
                          "the planner asks for 9 decode; kept at 4 (spec.planner allows 1 to 4)")


def test_sizes_the_spec_refuses_are_not_written_and_the_condition_says_why():
    # an embedded-engine pool with GPUs may exist only at 0 replicas
    c = cluster(prefill={"replicas": 0, "gpus": 1}, planner=PLANNER)
    plan = plan_replicas(c, view(prefill=1, decode=1))
    assert plan.patch is None and "spec.prefill.gpus must be 0" in plan.refused
    status = apply_planner_status({"conditions": []}, c, ControllerView("PD", planner=view()), plan, 3, NOW)
    state, reason, message = planner_condition(status)
    assert (state, reason) == ("False", "ReplicasRefused")
    assert "asks for 1 prefill and 1 decode" in message and "spec.prefill.gpus must be 0" in message


def test_status_section_is_the_view_rounded():
    p = view(request_rate=0.12345, measured_ttft_s=0.0421, measured_tpot_s=0.01234, ttft_target_s=2.0,
             tpot_target_s=0.1, prefill_tokens_per_s=812.345)
    assert build_planner_status(p) == {
        "advisory": False, "wantedPrefill": 1, "wantedDecode": 1, "replicasPrefill": 1, "replicasDecode": 1,
        "reason": SHRINK, "lastAction": "remove one prefill engine", "lastActionTime": "2026-01-01T00:00:00Z",
        "numActions": 1, "requestRate": 0.123, "measuredTtftSeconds": 0.042, "ttftTargetSeconds": 2.0,
        "measuredTpotSeconds": 0.012, "tpotTargetSeconds": 0.1, "prefillTokensPerSecond": 812.3}
    # before the first action: no action, no time (the merge patch drops them)
    fresh = build_planner_status(view(num_actions=0, last_action=""))
    assert fresh["lastAction"] is None and fresh["lastActionTime"] is None


def test_the_condition_is_true_when_balanced_and_says_what_the_planner_said():
    c = planned()
    answered = ControllerView("PD", planner=view(reason=BALANCED))
    status = apply_planner_status({"conditions": []}, c, answered, plan_replicas(c, answered.planner), 3, NOW)
    assert planner_condition(status) == ("False", "Rebalancing", BALANCED)  # the spec still holds 2 prefill
    c1 = cluster(prefill={"replicas": 1}, planner=PLANNER)
    status = apply_planner_status({"conditions": []}, c1, answered, plan_replicas(c1, answered.planner), 3, NOW)
    assert planner_condition(status) == ("True", "Balanced", BALANCED)
    assert status["planner"]["reason"] == BALANCED
    waiting = ControllerView("PD", planner=view(prefill=2, reason=f"waiting for the signal to hold (1/2): {SHRINK}"))
    status = apply_planner_status(status, c, waiting, plan_replicas(c, waiting.planner), 3, NOW)
    assert planner_condition(status)[:2] == ("False", "Rebalancing")
    advisory = ControllerView("PD", planner=view(prefill=2, advisory=True,
                                                 reason=f"advisory: would remove one prefill engine: {SHRINK}"))
    status = apply_planner_status(status, planned(advisory=True), advisory, None, 3, NOW)
    assert planner_condition(status)[:2] == ("False", "Advisory") and status["planner"]["advisory"]


def test_without_an_answer_the_last_report_stays_and_with_the_planner_off_it_goes():
    c = planned()
    reported = apply_planner_status({"conditions": []}, c, ControllerView("PD", planner=view()), None, 3, NOW)
    assert apply_planner_status(reported, c, None, None, 4, NOW) == reported
    first = apply_planner_status({"conditions": []}, c, None, None, 3, NOW)
    assert planner_condition(first)[:2] == ("Unknown", "WaitingForController") and first["planner"] is None
    # a Controller that started before the planner was enabled runs none
    none = apply_planner_status(reported, c, ControllerView("PD"), None, 3, NOW)
    assert planner_condition(none)[:2] == ("Unknown", "NotRunning") and none["planner"] is None
    off = apply_planner_status(reported, cluster(), ControllerView("PD", planner=view()), None, 5, NOW)
    assert planner_condition(off) is None and off["planner"] is None


def test_one_event_per_growth_of_the_number_of_actions():
    c = planned()
    assert planner_event(None, view(num_actions=0), c) is None
    # the first scale-down: the sizes asked for left the spec's (2 prefill)...
    assert planner_event(None, view(), c) == ("PlannerScaled", f"remove one prefill engine: {SHRINK}")
    # ...or those the last status was built from, once the operator followed them
    followed = cluster(prefill={"replicas": 1}, planner=PLANNER)
    assert planner_event({"desiredPrefill": 2, "desiredDecode": 1}, view(), followed)[0] == "PlannerScaled"
    status = {"desiredPrefill": 1, "desiredDecode": 1, "planner": build_planner_status(view())}
    assert planner_event(status, view(), c) is None  # reported already: nothing again
    switched = view(num_actions=2, last_action="switch c-decode-0 to prefill", reason="want 2 P + 0 D ...")
    assert planner_event(status, switched, c) == ("PlannerSwitchedRole",
                                                  "switch c-decode-0 to prefill: want 2 P + 0 D ...")
    reason, message = planner_event(status, view(prefill=0, num_actions=4), c)
    assert reason == "PlannerScaled" and message.endswith("(3 actions since the last report)")
    assert planner_event(status, None, c) is None


# --- whole passes -----------------------------------------------------------------

class MemoryKube(KubeClient):
    """The few API semantics reconcile relies on, in memory: create (409 when it
    exists), merge patches (a spec change bumps ``generation``; ``status`` only through
    its subresource), label-selected lists, deletes. ``refuse``: kind -> status code
    every spec patch of it gets."""

    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}
        self.refuse: dict[str, int] = {}
        self._uids = itertools.count(1)

    async def get(self, kind, namespace, name):
        return copy.deepcopy(self.objects.get(path(kind, namespace, name)))

    async def list(self, kind, namespace, labels):
        prefix = path(kind, namespace) + "/"
        return [copy.deepcopy(o) for key, o in self.objects.items()
                if key.startswith(prefix) and is_subset(labels, o["metadata"].get("labels") or {})]

    async def create(self, body):
        meta = body["metadata"]
        key = path(body["kind"], meta["namespace"], meta["name"])
        if key in self.objects:
            raise KubeError(409, f"{key} exists")
        obj = copy.deepcopy(body)
        obj["metadata"].update(uid=f"uid-{next(self._uids)}", generation=1)
        self.objects[key] = obj
        return copy.deepcopy(obj)

    async def patch(self, kind, namespace, name, patch, subresource=None):
        key = path(kind, namespace, name)
        if key not in self.objects:
            return None
        if subresource is None and "spec" in patch and kind in self.refuse:
            raise KubeError(self.refuse[kind], "refused")
        old = self.objects[key]
        if subresource != "status":
            patch = {k: v for k, v in patch.items() if k != "status"}
        new = merge_patch(old, patch)
        if new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] += 1
        self.objects[key] = new
        return copy.deepcopy(new)

    async def delete(self, kind, namespace, name):
        return self.objects.pop(path(kind, namespace, name), None) is not None

    def set_status(self, kind: str, name: str, status: dict) -> None:
        """The kubelet's and the Deployment controller's part."""
        obj = self.objects[path(kind, "ns", name)]
        obj["status"] = {**(obj.get("status") or {}), **status}

    def names(self, kind: str) -> list[str]:
        prefix = path(kind, "ns") + "/"
        return sorted(o["metadata"]["name"] for key, o in self.objects.items() if key.startswith(prefix))

    def pdcluster(self) -> dict:
        return self.objects[path("PDCluster", "ns", "c")]


class ScriptedController:
    """The Controller's answers: ``planner`` (its view's), drained instances."""

    def __init__(self) -> None:
        self.planner: pb.PlannerView | None = None
        self.drained: set[str] = set()
        self.drain_calls: list[str] = []

    def for_cluster(self, name, namespace, token=None):
        return self

    async def view(self):
        return ControllerView("PD", planner=self.planner)

    async def drain(self, instance_id, deadline_s):
        self.drain_calls.append(instance_id)
        return DrainState(instance_id in self.drained)

    async def list_replacements(self):
        return {}


async def no_checks(instances, security):
    return []


@pytest_asyncio.fixture
async def env():
    kube, ctrl = MemoryKube(), ScriptedController()
    doctor = DoctorRuns(checks=no_checks)
    reconciler = Reconciler(kube, ctrl, OperatorSettings(operator_namespace="ns"), clock=lambda: NOW,
                            doctor=doctor)
    body = planned().to_manifest()
    body["metadata"] = {"name": "c", "namespace": "ns"}
    await kube.create(body)
    yield kube, ctrl, reconciler
    await doctor.close()


async def settle(kube: MemoryKube, reconciler: Reconciler) -> list[tuple[str, str]]:
    """One pass, then what the kubelet and the Deployment controller would do (every
    engine Pod Running and Ready, the control plane available); the pass's Events."""
    events = await reconciler.reconcile(kube.pdcluster())
    for pod in kube.names("Pod"):
        kube.set_status("Pod", pod, {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]})
    for component in ("controller", "coordinator"):
        kube.set_status("Deployment", f"c-{component}", {"availableReplicas": 1})
    return [(e.reason, e.message) for e in events]


@pytest.mark.asyncio
async def test_a_pass_patches_the_spec_drains_the_surplus_reports_and_undoes_a_hand_edit(env):
    kube, ctrl, reconciler = env
    await settle(kube, reconciler)
    assert kube.names("PDInstance") == ["c-decode-0", "c-prefill-0", "c-prefill-1"]

    # the planner removes a prefill engine: the spec follows, the surplus drains
    ctrl.planner = view()
    events = await settle(kube, reconciler)
    pdc = kube.pdcluster()
    assert pdc["spec"]["prefill"]["replicas"] == 1 and pdc["spec"]["decode"]["replicas"] == 1
    reasons = [r for r, _ in events]
    assert reasons.count("FollowedPlanner") == 1 and reasons.count("PlannerScaled") == 1, events
    assert ("FollowedPlanner", "spec.prefill.replicas 2 -> 1 (the SLO planner's pool sizes)") in events
    assert "Draining" in reasons and ctrl.drain_calls == ["c-prefill-1"]
    status = pdc["status"]
    # the status was written from the patched spec, in the same pass
    assert status["observedGeneration"] == pdc["metadata"]["generation"] == 2
    assert (status["desiredPrefill"], status["planner"]["replicasPrefill"], status["planner"]["numActions"]) == (1, 1, 1)
    assert planner_condition(status) == ("False", "Rebalancing", SHRINK)

    # drained: deleted; the same action is not reported twice
    ctrl.drained.add("c-prefill-1")
    events = await settle(kube, reconciler)
    assert ("DeletedInstance", "deleted c-prefill-1 (drained)") in events
    assert not [r for r, _ in events if r.startswith("Planner") or r == "FollowedPlanner"], events
    assert kube.names("PDInstance") == ["c-decode-0", "c-prefill-0"]

    # balanced: the condition turns True
    ctrl.planner = view(reason=BALANCED)
    await settle(kube, reconciler)
    assert planner_condition(kube.pdcluster()["status"]) == ("True", "Balanced", BALANCED)

    # the planner owns the field: a hand edit is set back on the next pass
    await kube.patch("PDCluster", "ns", "c", {"spec": {"prefill": {"replicas": 3}}})
    events = await settle(kube, reconciler)
    assert kube.pdcluster()["spec"]["prefill"]["replicas"] == 1
    assert ("FollowedPlanner", "spec.prefill.replicas 3 -> 1 (the SLO planner's pool sizes)") in events
    assert kube.names("PDInstance") == ["c-decode-0", "c-prefill-0"]  # c-prefill-2 never made


@pytest.mark.asyncio
async def test_advisory_or_a_refused_patch_changes_no_replicas(env):
    kube, ctrl, reconciler = env
    await settle(kube, reconciler)
    ctrl.planner = view(advisory=True, reason=f"advisory: would remove one prefill engine: {SHRINK}", num_actions=0,
                        prefill=2)
    events = await settle(kube, reconciler)
    pdc = kube.pdcluster()
    assert pdc["spec"]["prefill"]["replicas"] == 2 and not [r for r, _ in events if "Planner" in r]
    assert planner_condition(pdc["status"])[:2] == ("False", "Advisory")
    # the apiserver refuses the patch (say, an admission webhook): reported, the pass goes on
    ctrl.planner, kube.refuse["PDCluster"] = view(), 422
    await settle(kube, reconciler)
    pdc = kube.pdcluster()
    assert pdc["spec"]["prefill"]["replicas"] == 2 and kube.names("PDInstance") == [
        "c-decode-0", "c-prefill-0", "c-prefill-1"]
    state, reason, message = planner_condition(pdc["status"])
    assert (state, reason) == ("False", "ReplicasRefused") and "HTTP 422" in message
    assert b.CLUSTER_LABEL in kube.objects[path("PDInstance", "ns", "c-prefill-1")]["metadata"]["labels"]
