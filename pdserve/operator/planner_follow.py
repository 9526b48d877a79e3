"""The operator's side of the SLO planner: the PDCluster follows the pool sizes the
planner asks for, and its status and Events say what the planner decided. The
planner itself runs on the Controller's leader (``controller/planner.py``) and
publishes its last decision in the Controller's view (``PlannerView``); reconcile
reads it once a pass and applies what the pure functions here return.

Ownership: while ``spec.planner`` is enabled and not advisory, the planner owns
``spec.prefill.replicas`` and ``spec.decode.replicas``, as a HorizontalPodAutoscaler
owns a Deployment's replicas: the operator sets them to the planner's sizes on
every pass, so a change by hand is set back, and so is a scale of those pools'
PDPools (``pdpools.py``: an autoscaler and the planner must not both size a pool).
To size the pools by hand, change ``spec.planner``'s bounds, or turn the planner off
(the sizes it left stay, and are the user's again). The usual scale paths then do the work: a larger pool gets new
PDInstances, a smaller one has its highest ordinals drained and deleted.

- ``plan_replicas``: the merge patch that makes the two replicas fields the planner's
  ``replicasPrefill`` / ``replicasDecode``, kept within ``spec.planner``'s minimums
  and maximums (at least 1, so never below 0): a guard, the planner keeps within
  them itself. Sizes the spec's own rules refuse (a pool with GPUs on
  the embedded engine, say) are not written, and the condition says why. Nothing to
  follow (None) while the planner is off or advisory, or the Controller sends no
  planner.
- ``build_planner_status``: ``status.planner``, the decision as published, measures
  rounded (to the millisecond, the thousandth of a request per second) so that a
  steady cluster's status does not change at every pass.
- ``build_planner_condition``: the ``Planner`` condition:
  - True, ``Balanced``: the last decision needs no action (``is_balanced``: the
    engines it wants run) and the spec holds the planner's sizes;
  - False, ``Rebalancing``: the planner wants another split or size, and waits for
    its signal to hold, its cooldown or a pending engine, or acts;
  - False, ``Advisory``: advisory mode, and the planner would act (it never does);
  - False, ``ReplicasRefused``: its sizes break the spec's rules or the apiserver
    refused them (the message says which);
  - Unknown, ``NotRunning``: the Controller answered without a planner (one that
    started before the planner was enabled runs without it until it restarts);
  - Unknown, ``WaitingForController``: no answer from the Controller yet.
- ``planner_event``: one Event each time ``numActions`` grows: ``PlannerScaled``
  when the pool sizes asked for changed since the last status, else
  ``PlannerSwitchedRole``; its message is the last action and the planner's reason.

Invariants: pure (no I/O, no clock: ``now`` is passed); without an answer from the
Controller the section and the condition keep their last values; with the planner
off neither exists; an Event is due only when the view's ``numActions`` is above the
one ``status.planner`` holds, so a repeated pass, or a restarted operator, posts it
once.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pdserve.api import PDCluster
from pdserve.api.conditions import set_condition
from pdserve.api.manifest import ManifestError, parse_manifest
from pdserve.api.proto import controller_pb2 as pb
from pdserve.operator.controller_client import ControllerView
from pdserve.operator.status import parse_conditions, rfc3339

CONDITION = "Planner"


@dataclass(frozen=True)
class ReplicaPlan:
    """What one pass does with the planner's pool sizes."""

    replicas: dict[str, int]       # pool -> the size the spec is to hold
    patch: dict | None = None      # merge patch of the PDCluster; None: the spec holds them
    refused: str | None = None     # why the sizes cannot be written
    notes: tuple[str, ...] = ()    # sizes kept within spec.planner's bounds


def is_following(cluster: PDCluster) -> bool:
    """Whether the spec asks the operator to follow the planner's pool sizes."""
    return cluster.spec.planner.enabled and not cluster.spec.planner.advisory


def plan_replicas(cluster: PDCluster, planner: pb.PlannerView | None) -> ReplicaPlan | None:
    """The replicas the spec is to hold, and the patch that sets them. Called by
    reconcile on every pass with the view it read; None when there is nothing to follow."""
    if planner is None or planner.advisory or not is_following(cluster):
        return None
    spec = cluster.spec.planner
    bounds = {"prefill": (spec.min_prefill, spec.max_prefill), "decode": (spec.min_decode, spec.max_decode)}
    asked = {"prefill": planner.replicas_prefill, "decode": planner.replicas_decode}
    want = {pool: min(max(asked[pool], low, 0), high) for pool, (low, high) in bounds.items()}
    notes = tuple(f"the planner asks for {asked[pool]} {pool}; kept at {want[pool]} "
                  f"(spec.planner allows {low} to {high})"
                  for pool, (low, high) in bounds.items() if want[pool] != asked[pool])
    changed = {pool: {"replicas": n} for pool, n in want.items()
               if getattr(cluster.spec, pool).replicas != n}
    if not changed:
        return ReplicaPlan(want, notes=notes)
    problems = replicas_problems(cluster, {pool: want[pool] for pool in changed})
    if problems:
        return ReplicaPlan(want, refused="the spec's rules refuse them: " + "; ".join(problems),
                           notes=notes)
    return ReplicaPlan(want, patch={"spec": changed}, notes=notes)


def replicas_problems(cluster: PDCluster, replicas: dict[str, int]) -> list[str]:
    """Why the spec's rules refuse ``cluster`` with the pools' ``replicas`` (pool -> size)
    changed; [] when they take it. The same validation as the apiserver's (the models'
    validators mirror the CRD's rules). Called by ``plan_replicas`` and, for a PDPool's
    scale, by ``pdpools.sync_pool``."""
    manifest = cluster.to_manifest()
    manifest.pop("status", None)
    for pool, n in replicas.items():
        manifest["spec"][pool] = {**manifest["spec"].get(pool, {}), "replicas": n}
    try:
        parse_manifest(manifest, PDCluster, "the pool sizes")
    except ManifestError as exc:
        return list(exc.problems)
    return []


def describe_patch(cluster: PDCluster, plan: ReplicaPlan) -> str:
    """The message of the Event reconcile posts once it wrote ``plan.patch``."""
    return ", ".join(f"spec.{pool}.replicas {getattr(cluster.spec, pool).replicas} -> {n}"
                     for pool, n in plan.replicas.items() if getattr(cluster.spec, pool).replicas != n
                     ) + " (the SLO planner's pool sizes)"


def build_planner_status(planner: pb.PlannerView) -> dict:
    """``status.planner`` from the view (keys with None are removed by the merge patch)."""
    return {
        "advisory": planner.advisory,
        "wantedPrefill": planner.wanted_prefill, "wantedDecode": planner.wanted_decode,
        "replicasPrefill": planner.replicas_prefill, "replicasDecode": planner.replicas_decode,
        "reason": planner.reason,
        "lastAction": planner.last_action or None,
        "lastActionTime": rfc3339(planner.last_action_unix_s) if planner.last_action_unix_s else None,
        "numActions": planner.num_actions,
        "requestRate": round(planner.request_rate, 3),
        "measuredTtftSeconds": round(planner.measured_ttft_s, 3),
        "ttftTargetSeconds": round(planner.ttft_target_s, 3),
        "measuredTpotSeconds": round(planner.measured_tpot_s, 3),
        "tpotTargetSeconds": round(planner.tpot_target_s, 3),
        "prefillTokensPerSecond": round(planner.prefill_tokens_per_s, 1),
    }


def build_planner_condition(cluster: PDCluster, planner: pb.PlannerView | None,
                            plan: ReplicaPlan | None) -> tuple[str, str, str]:
    """(status, reason, message) of the ``Planner`` condition, from a Controller that
    answered (``planner``: its view's, None when it runs none); the rules are the module's."""
    if planner is None:
        return ("Unknown", "NotRunning", "the Controller runs no planner yet (a Controller started "
                "before spec.planner was enabled runs without it until it restarts)")
    message = "; ".join((planner.reason, *(plan.notes if plan else ())))
    if plan is not None and plan.refused:
        return ("False", "ReplicasRefused", f"the planner asks for {planner.replicas_prefill} prefill and "
                f"{planner.replicas_decode} decode engines; {plan.refused}")
    if planner.is_balanced and (plan is None or plan.patch is None):
        return "True", "Balanced", message
    if planner.advisory or cluster.spec.planner.advisory:
        return "False", "Advisory", message
    return "False", "Rebalancing", message


def apply_planner_status(status: dict, cluster: PDCluster, view: ControllerView | None,
                         plan: ReplicaPlan | None, generation: int | None, now: datetime) -> dict:
    """``status`` (from ``build_status``, which carried the old conditions over) with
    ``planner`` and the ``Planner`` condition set, or both removed while the planner is
    off. Called by reconcile before it writes the status; ``view`` None: the Controller
    did not answer, the last section and condition stay."""
    conditions = parse_conditions(status)
    if not cluster.spec.planner.enabled:
        kept = [c.to_manifest() for c in conditions if c.type != CONDITION]
        return {**status, "planner": None, "conditions": kept}
    if view is None:
        if any(c.type == CONDITION for c in conditions):
            return status  # the last section (written by an earlier pass) is left as it is
        triple = ("Unknown", "WaitingForController", "the Controller has not answered yet")
        section = None
    else:
        triple = build_planner_condition(cluster, view.planner, plan)
        section = build_planner_status(view.planner) if view.planner is not None else None
    conditions = set_condition(conditions, CONDITION, *triple, generation, now)
    return {**status, "planner": section, "conditions": [c.to_manifest() for c in conditions]}


def planner_event(old_status: dict | None, planner: pb.PlannerView | None,
                  cluster: PDCluster) -> tuple[str, str] | None:
    """(reason, message) of the Event due for the planner's actions since the status
    last written (``old_status``, the PDCluster's), or None. A size change is told by
    the pool sizes asked for, against those last written in ``status.planner``, else
    those the last status was built from (where the planner started, before the
    operator followed it), else the spec's; anything else it does is a role switch."""
    if planner is None:
        return None
    old_status = old_status or {}
    section = old_status.get("planner") or {}
    num_new = planner.num_actions - int(section.get("numActions") or 0)
    if num_new <= 0:
        return None
    before = tuple(section.get(key, old_status.get(desired, getattr(cluster.spec, pool).replicas))
                   for key, desired, pool in (("replicasPrefill", "desiredPrefill", "prefill"),
                                              ("replicasDecode", "desiredDecode", "decode")))
    is_scale = before != (planner.replicas_prefill, planner.replicas_decode)
    message = f"{planner.last_action or 'an action'}: {planner.reason}"
    if num_new > 1:
        message += f" ({num_new} actions since the last report)"
    return ("PlannerScaled" if is_scale else "PlannerSwitchedRole"), message
