"""Reconcile one PDCluster: observe, build the desired objects, apply the difference,
write status. Level-triggered: it reads everything each time and keeps no state
between calls except per-cluster locks, the operator's key (read once) and the
doctor's latest findings (``doctor.DoctorRuns``), so running it again changes nothing.

Order of a pass: the cluster token Secret (``_create_token_secret``, create only); the
static objects of ``desired.build_static_objects`` (cluster and engine files,
Services, Controller and Coordinator Deployments, PodDisruptionBudgets:
``_apply_static``); the Controller's view and, with ``spec.planner`` on, the SLO
planner's pool sizes (``_follow_planner``: replicas that differ are patched into the
spec and the pass starts again from the patched PDCluster, so that one pass builds
everything from one spec; ``planner_follow.py`` says who owns those fields); the
PDPools (``_sync_pdpools``: created where missing; a scale request written into the
spec, the pass then starting again from the patched PDCluster as for the planner, or
refused; otherwise set to the spec's sizes: ``pdpools.py`` has the rule); PDInstances
(``_create_instances``; ``_scale_down``: drain surplus, then delete); the Controller's
replacement requests (``_apply_replacements``: delete the Pod, acknowledge); engine
Pods (``_apply_engine_pods``, the one place that creates Pods, built by
``pods.build_engine_pod``: recreate failed ones, roll stale ones, create missing
ones); static objects no longer built (``_prune``); PDInstance status (from the Pods
and the Controller's view); PDCluster status, with the ``Doctor`` condition from the
latest doctor findings, and the planner's section and ``Planner`` condition (an Event
for its actions since the last status); the PDPools' status (engines, ready engines,
selector, the spec's size they were synced with); last, a doctor run starts in the
background when one is due (``DoctorRuns.start_if_due``: the pass never waits for it).

Rollout of engine settings: each pool's Pods carry the hash of what they run
(``pods.engine_pod_hash``); a change of it replaces the pool's Pods one at a time,
each after the previous new one is Ready, never the last serving Pod of two pools
at once (``rollout.choose_replacements``). Settings no engine reads (routing,
fallback, SLOs, heartbeat thresholds, the control plane) roll only the Deployments
that read them.

Calls on many instances within a step (creating PDInstances and Pods, draining and
deleting surplus ones, writing PDInstance status, a finalizer's deletes) run up to
``settings.api_concurrency`` at once (``_each``); the steps stay in this order, each
waiting for all its calls, and a failed call fails the pass only after the others
ended (what they wrote is recorded: nothing is written twice on the retry).

Invariants: only ``kube.KubeClient`` touches the API; the operator never reads a
Secret but its own key (cluster tokens are derived from it: ``tokens.py``); a
Controller that does not answer never stops the pass (drains wait for their
deadline instead); an instance is deleted only after the Controller says it is
drained, or its drain deadline passed, or its Pod is not running (nothing to drain).

Past 500 lines on purpose: it is every API call of a pass, in order, and nothing
else; each decision is a pure function of the modules named above.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from pdserve.api import PDCluster
from pdserve.api.conditions import is_condition_true
from pdserve.api.manifest import ManifestError, parse_manifest
from pdserve.api.pool import pdpool_name
from pdserve.operator import builders as b
from pdserve.operator import pdpools
from pdserve.operator.controller_client import (
    ControllerClient,
    ControllerClients,
    ControllerUnavailable,
    ControllerView,
)
from pdserve.operator.desired import PRUNED, build_static_objects, engine_pod_hashes
from pdserve.operator.doctor import DoctorRuns, apply_doctor_condition
from pdserve.operator.kube import KubeClient, KubeError, is_subset
from pdserve.operator.planner_follow import (
    ReplicaPlan,
    apply_planner_status,
    describe_patch,
    plan_replicas,
    planner_event,
)
from pdserve.operator.pods import build_engine_pod
from pdserve.operator.rollout import EnginePod, choose_replacements
from pdserve.operator.settings import OperatorSettings
from pdserve.operator.status import (
    Observation,
    build_instance_status,
    build_invalid_status,
    build_status,
    is_available,
    is_pod_serving,
    is_unhealthy,
    parse_conditions,
)
from pdserve.operator.tokens import derive_cluster_token, load_operator_key
from pdserve.runtime.aio import gather_limited


class InvalidSpec(Exception):
    """The spec cannot be reconciled; the message names each bad field."""


class NotYet(Exception):
    """A step waits for something outside the operator (Pods terminating, the Controller)."""


@dataclass(frozen=True)
class Event:
    type: str      # Normal | Warning
    reason: str
    message: str
    about: dict | None = None  # the object it is posted on (a body); None: the PDCluster


def _name(obj: dict) -> str:
    return obj["metadata"]["name"]


def _is_deleting(obj: dict | None) -> bool:
    return bool(obj and obj["metadata"].get("deletionTimestamp"))


def _phase(pod: dict | None) -> str | None:
    return ((pod or {}).get("status") or {}).get("phase")


class Reconciler:
    """Called by the kopf handlers; one per operator process."""

    def __init__(self, kube: KubeClient, controllers: ControllerClients, settings: OperatorSettings,
                 clock=lambda: datetime.now(UTC), doctor: DoctorRuns | None = None) -> None:
        self.kube, self.controllers, self.settings, self.clock = kube, controllers, settings, clock
        self.doctor = doctor or DoctorRuns()
        self._locks: dict[tuple[str, str], asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._queued: set[tuple[str, str]] = set()
        self._key: bytes | None = None

    async def _each(self, items, call) -> list:
        """``await call(item)`` for every item, at most ``settings.api_concurrency`` at
        once; the results in item order. Each call of a step is its own object's (a
        scale of 200 engines is 400 creates: one after another they took 1.4-1.7 s on an
        emulator answering in a millisecond, and a real apiserver answers in several).
        Every call runs to its end, then the first error in item order is raised."""
        results = await gather_limited(items, call, self.settings.api_concurrency)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    def parse(self, body: dict) -> PDCluster:
        meta = body["metadata"]
        raw = {**body, "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "generation")}}
        try:
            return parse_manifest(raw, PDCluster, f"PDCluster {meta.get('namespace')}/{meta['name']}")
        except ManifestError as exc:
            raise InvalidSpec("; ".join(exc.problems)) from None

    async def cluster_token(self, namespace: str, name: str, uid: str | None) -> str:
        """The token of a PDCluster (loads the operator's key on first use)."""
        if self._key is None:
            self._key = await load_operator_key(self.kube, self.settings.operator_namespace,
                                                self.settings.key_secret)
        return derive_cluster_token(self._key, namespace, name, uid)

    def is_queued(self, namespace: str, name: str) -> bool:
        """Whether a pass for PDCluster ``namespace/name`` waits to start. Called by the
        child-event handler: that pass reads everything afresh, so the event adds nothing
        to it, not even a read of the PDCluster."""
        return (namespace, name) in self._queued

    async def reconcile(self, body: dict, coalesce: bool = False) -> list[Event]:
        """One pass for ``body`` (a PDCluster). Raises InvalidSpec, KubeError.

        With ``coalesce`` (child events, resyncs) the call returns at once when a
        pass for the cluster is already waiting: that pass starts later and reads
        everything afresh, so it sees whatever this caller would have seen."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if coalesce and key in self._queued:
            return []
        self._queued.add(key)
        async with self._locks[key]:
            self._queued.discard(key)
            fresh = await self.kube.get("PDCluster", meta["namespace"], meta["name"])
            if fresh is None or _is_deleting(fresh):
                return []
            return await self._reconcile(fresh)

    async def _reconcile(self, body: dict, may_patch_spec: bool = True) -> list[Event]:
        """One pass over ``body``. ``may_patch_spec``: whether the pass may write the
        planner's or a PDPools' replicas into the spec (a pass that did starts again from
        the patched PDCluster, without it: no loop)."""
        generation = body["metadata"].get("generation")
        try:
            cluster = self.parse(body)
        except InvalidSpec as exc:
            await self._write_status(body, build_invalid_status(generation, body.get("status"),
                                                                str(exc), self.clock()))
            raise
        events: list[Event] = []
        ns, name = cluster.metadata.namespace, cluster.metadata.name
        token = await self.cluster_token(ns, name, cluster.metadata.uid)
        await self._create_token_secret(cluster, token, events)
        obs = Observation(pod_hashes=engine_pod_hashes(cluster, self.settings))
        static = build_static_objects(cluster, self.settings)
        obs.deployments = await self._apply_static(static, events)
        obs.coordinator_slices = await self.kube.list(
            "EndpointSlice", ns, {b.SERVICE_NAME_LABEL: b.coordinator_service_name(cluster)})
        obs.instances = {_name(i): i for i in await self.kube.list("PDInstance", ns, {b.CLUSTER_LABEL: name})}
        obs.pods = {_name(p): p for p in await self.kube.list("Pod", ns, b.selector(cluster, "engine"))}
        # no call to a Controller that has no available replica (it would only time out)
        ctrl = (self.controllers.for_cluster(name, ns, token)
                if is_available(obs.deployments.get("controller")) else None)
        view: ControllerView | None = None
        try:
            view = await ctrl.view() if ctrl else None
        except ControllerUnavailable:
            view = None
        plan = plan_replicas(cluster, view.planner if view else None)
        if may_patch_spec and plan is not None and plan.patch is not None:
            patched, plan = await self._follow_planner(cluster, plan, events)
            if patched is not None:
                return events + await self._reconcile(patched, may_patch_spec=False)
            if plan.patch is not None:
                return events  # deleted meanwhile
        pools = await self._list_pdpools(cluster)
        if pools is not None:
            patched = await self._sync_pdpools(cluster, pools, events, may_patch_spec)
            if patched is not None:
                return events + await self._reconcile(patched, may_patch_spec=False)
        await self._create_instances(cluster, obs, events)
        await self._scale_down(cluster, obs, ctrl, events)
        await self._apply_replacements(cluster, obs, ctrl, events)
        await self._apply_engine_pods(cluster, obs, events)
        await self._prune(cluster, obs, {_name(o) for o in static})
        obs.controller_mode = view.mode if view else None
        await self._write_instance_statuses(cluster, obs, view)
        status = build_status(cluster, generation, body.get("status"), obs, self.clock())
        status = apply_doctor_condition(status, self.doctor.latest((ns, name)), generation, self.clock())
        status = apply_planner_status(status, cluster, view, plan, generation, self.clock())
        due = planner_event(body.get("status"), view.planner if view else None, cluster)
        if due is not None:
            events.append(Event("Normal", *due))
        await self._write_status(body, status)
        if pools is not None:
            await self._write_pdpool_statuses(cluster, pools, obs, status)
        if view is not None:
            self.doctor.start_if_due((ns, name), is_condition_true(parse_conditions(status), "Ready"),
                                     view.instances, token)
        return events

    async def _create_token_secret(self, cluster: PDCluster, token: str, events: list[Event]) -> None:
        """Create ``<cluster>-token`` unless it exists (409): the operator may create and
        delete Secrets, never read them."""
        try:
            await self.kube.create(b.build_token_secret(cluster, token))
        except KubeError as exc:
            if exc.status != 409:
                raise
            return
        events.append(Event("Normal", "CreatedToken", f"created Secret {b.token_secret_name(cluster.metadata.name)}"))

    async def _apply_static(self, objects: list[dict], events: list[Event]) -> dict[str, dict | None]:
        deployments = {}
        for obj in objects:
            result, observed = await self.kube.apply(obj)
            if result != "unchanged":
                events.append(Event("Normal", result.capitalize(), f"{result} {obj['kind']} {_name(obj)}"))
            if obj["kind"] == "Deployment":
                deployments[obj["spec"]["template"]["metadata"]["labels"][b.COMPONENT_LABEL]] = observed
        return deployments

    async def _follow_planner(self, cluster: PDCluster, plan: ReplicaPlan,
                              events: list[Event]) -> tuple[dict | None, ReplicaPlan]:
        """Patch the spec's replicas to the planner's sizes (``plan.patch``). Returns the
        patched PDCluster and the plan; None when the PDCluster is gone, or with the plan
        marked refused (no patch) when the apiserver will not take them: the pass goes
        on with the spec as it is and the ``Planner`` condition says why (the next pass
        asks again)."""
        meta = cluster.metadata
        try:
            patched = await self.kube.patch("PDCluster", meta.namespace, meta.name, plan.patch)
        except KubeError as exc:
            if exc.is_transient:
                raise
            return None, replace(plan, patch=None, refused=f"the API refused them: {exc}")
        if patched is not None:
            events.append(Event("Normal", "FollowedPlanner", describe_patch(cluster, plan)))
        return patched, plan

    async def _list_pdpools(self, cluster: PDCluster) -> dict[str, dict] | None:
        """The cluster's PDPools by pool; None while their CRD is not installed (helm
        installs a chart's CRDs once and never upgrades them: an upgraded operator may
        run before ``kubectl apply -f crds/``), and the pass goes on without them."""
        name = cluster.metadata.name
        try:
            found = await self.kube.list("PDPool", cluster.metadata.namespace,
                                         {b.CLUSTER_LABEL: name, b.COMPONENT_LABEL: pdpools.COMPONENT})
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        return {p["spec"]["pool"]: p for p in found
                if _name(p) == pdpool_name(name, p["spec"].get("pool", ""))}

    async def _sync_pdpools(self, cluster: PDCluster, pools: dict[str, dict], events: list[Event],
                            may_patch_spec: bool) -> dict | None:
        """Each pool's PDPool by ``pdpools.sync_pool``: create a missing one, write an
        accepted scale request into the PDCluster (with ``may_patch_spec``; else the next
        pass does), refuse the others with a Warning on the PDPool, and set ``spec.replicas``
        to the PDCluster's size where no request is pending. Returns the patched
        PDCluster, None when this pass did not patch it. ``pools`` is updated in place."""
        ns, patched = cluster.metadata.namespace, None
        for pool in b.POOLS:
            pdpool = pools.get(pool)
            if pdpool is None:
                created = await self._create_pdpool(cluster, pool, events)
                if created is not None:
                    pools[pool] = created
                continue
            sync = pdpools.sync_pool(cluster, pool, pdpool)
            if sync.is_accepted:
                if not may_patch_spec:
                    continue
                try:
                    result = await self.kube.patch("PDCluster", ns, cluster.metadata.name,
                                                   {"spec": {pool: {"replicas": sync.asked}}})
                except KubeError as exc:
                    if exc.is_transient:
                        raise
                    sync = replace(sync, refused=f"the API refused it: {exc}")
                else:
                    if result is None:
                        return None  # the PDCluster is gone
                    events.append(Event("Normal", "ScaledByPool", pdpools.describe_scale(cluster, sync)))
                    patched, cluster = result, self.parse(result)
                    continue
            if sync.refused:
                events.append(Event("Warning", "ScaleRefused", pdpools.describe_refusal(sync), about=pdpool))
            if pdpool["spec"].get("replicas") != sync.cluster_replicas:
                pools[pool] = await self._set_pdpool_replicas(pdpool, sync.cluster_replicas)
        return patched

    async def _create_pdpool(self, cluster: PDCluster, pool: str, events: list[Event]) -> dict | None:
        body = pdpools.build_pdpool(cluster, pool)
        try:
            created = await self.kube.create(body)
        except KubeError as exc:
            if exc.status != 409:  # 409: made meanwhile; the next pass reads it
                raise
            return None
        events.append(Event("Normal", "Created", f"created PDPool {_name(body)}"))
        return created

    async def _set_pdpool_replicas(self, pdpool: dict, replicas: int) -> dict:
        """``spec.replicas`` of ``pdpool`` set to ``replicas``, if nobody scaled it since it
        was read (its resourceVersion): a scale made meanwhile is a request the next pass
        reads (its event starts that pass)."""
        meta = pdpool["metadata"]
        patch = {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "spec": {"replicas": replicas}}
        try:
            return await self.kube.patch("PDPool", meta["namespace"], meta["name"], patch) or pdpool
        except KubeError as exc:
            if exc.status != 409:
                raise
            return pdpool

    async def _write_pdpool_statuses(self, cluster: PDCluster, pools: dict[str, dict], obs: Observation,
                                     status: dict) -> None:
        for pool, pdpool in pools.items():
            want = pdpools.build_pdpool_status(cluster, pdpool, list(obs.pods.values()),
                                               status[f"ready{pool.capitalize()}"])
            if not is_subset(want, pdpool.get("status") or {}):
                await self.kube.patch("PDPool", cluster.metadata.namespace, _name(pdpool), {"status": want},
                                      subresource="status")

    async def _create_instances(self, cluster: PDCluster, obs: Observation, events: list[Event]) -> None:
        desired = b.desired_instances(cluster)

        async def one(name: str) -> Event:
            inst = obs.instances.get(name)
            if inst is None:
                pool, ordinal = desired[name]
                obs.instances[name] = await self.kube.create(b.build_instance(cluster, pool, ordinal))
                return Event("Normal", "CreatedInstance", f"created PDInstance {name}")
            # scaled back up while draining: its engine stopped admitting, start it afresh
            patch = {"metadata": {"annotations": {b.DRAIN_ANNOTATION: None}}}
            obs.instances[name] = await self.kube.patch("PDInstance", cluster.metadata.namespace,
                                                        name, patch) or inst
            if name in obs.pods and await self.kube.delete("Pod", cluster.metadata.namespace, name):
                obs.pods.pop(name)
            return Event("Normal", "DrainCancelled", f"{name} is wanted again; Pod restarted")

        todo = [name for name in desired if name not in obs.instances
                or b.DRAIN_ANNOTATION in (obs.instances[name]["metadata"].get("annotations") or {})]
        events += await self._each(todo, one)

    async def _scale_down(self, cluster: PDCluster, obs: Observation, ctrl: ControllerClient | None,
                          events: list[Event]) -> None:
        desired = b.desired_instances(cluster)
        now = self.clock().timestamp()
        deadline_s = self.settings.drain_deadline_s

        async def one(name: str) -> list[Event]:
            inst, pod = obs.instances[name], obs.pods.get(name)
            if _phase(pod) != "Running" or _is_deleting(pod):
                await self._delete_instance(cluster, obs, name)
                return [Event("Normal", "DeletedInstance", f"deleted {name} (scaled down; not running)")]
            out = []
            started = (inst["metadata"].get("annotations") or {}).get(b.DRAIN_ANNOTATION)
            if started is None:
                started = f"{now:.3f}"
                await self.kube.patch("PDInstance", cluster.metadata.namespace, name,
                                      {"metadata": {"annotations": {b.DRAIN_ANNOTATION: started}}})
                out.append(Event("Normal", "Draining", f"draining {name} before deleting it "
                                                       f"(deadline {deadline_s:g}s)"))
            try:
                is_drained = bool(ctrl) and (await ctrl.drain(name, deadline_s)).is_drained
            except ControllerUnavailable:
                is_drained = False
            if is_drained or now - float(started) >= deadline_s:
                await self._delete_instance(cluster, obs, name)
                reason, why = ("DeletedInstance", "drained") if is_drained else ("DrainTimeout", "drain deadline passed")
                out.append(Event("Normal" if is_drained else "Warning", reason, f"deleted {name} ({why})"))
            else:
                obs.draining.append(name)
            return out

        surplus = [name for name in obs.instances if name not in desired]
        for found in await self._each(surplus, one):
            events += found

    async def _delete_instance(self, cluster: PDCluster, obs: Observation, name: str) -> None:
        ns = cluster.metadata.namespace
        await self.kube.delete("Pod", ns, name)  # the GC would too (owner); do not wait for it
        await self.kube.delete("PDInstance", ns, name)
        obs.pods.pop(name, None)
        obs.instances.pop(name, None)

    async def _apply_replacements(self, cluster: PDCluster, obs: Observation, ctrl: ControllerClient | None,
                                  events: list[Event]) -> None:
        """The Controller's replacement requests (repeated failures): delete the Pod
        (``_apply_engine_pods`` creates the new one), then acknowledge."""
        if ctrl is None:
            return
        try:
            requests = await ctrl.list_replacements()
        except ControllerUnavailable:
            return
        for name, reason in sorted(requests.items()):
            pod = obs.pods.get(name)
            if pod is not None and not _is_deleting(pod):
                await self.kube.delete("Pod", cluster.metadata.namespace, name)
                obs.pods.pop(name)
                obs.replaced.append(name)
                events.append(Event("Warning", "ReplacingInstance",
                                    f"recreating the Pod of {name}: {reason}"))
            try:
                await ctrl.ack_replacement(name)
            except ControllerUnavailable:
                return  # asked again next pass; the new Pod is left alone then (not yet Running)

    def _rollout_view(self, cluster: PDCluster, obs: Observation) -> list[EnginePod]:
        """The desired instances' Pods as ``rollout.choose_replacements`` sees them."""
        pods = []
        for name, (pool, ordinal) in b.desired_instances(cluster).items():
            pod = obs.pods.get(name)
            if pod is None:
                continue
            inst = obs.instances.get(name) or {}
            pods.append(EnginePod(
                name, pool, ordinal,
                is_current=pod["metadata"]["labels"].get(b.SPEC_HASH_LABEL) == obs.pod_hashes[pool],
                is_serving=is_pod_serving(pod) and not is_unhealthy(inst),
                is_terminating=_is_deleting(pod)))
        return pods

    async def _apply_engine_pods(self, cluster: PDCluster, obs: Observation, events: list[Event]) -> None:
        """Engine Pods: delete failed ones and the stale ones the rollout picks, then
        create each missing one from ``build_engine_pod``."""
        ns = cluster.metadata.namespace
        desired = b.desired_instances(cluster)
        for name in desired:
            pod = obs.pods.get(name)
            if pod is not None and _phase(pod) in ("Failed", "Succeeded") and not _is_deleting(pod):
                await self.kube.delete("Pod", ns, name)
                obs.pods.pop(name)
                events.append(Event("Warning", "PodFailed", f"Pod {name} {_phase(pod)}; recreating it"))
        pods = self._rollout_view(cluster, obs)
        obs.num_stale_pods = sum(not p.is_current for p in pods)
        replicas = {pool: getattr(cluster.spec, pool).replicas for pool in b.POOLS}
        for name in choose_replacements(pods, replicas):
            pool = desired[name][0]
            old = obs.pods[name]["metadata"]["labels"].get(b.SPEC_HASH_LABEL)
            await self.kube.delete("Pod", ns, name)
            obs.pods.pop(name)
            events.append(Event("Normal", "RollingEngines",
                                f"replacing Pod {name}: {pool} settings {old} -> {obs.pod_hashes[pool]}"))

        async def create(name: str) -> Event | None:
            pool = desired[name][0]
            body = build_engine_pod(cluster, name, pool, obs.instances[name]["metadata"].get("uid"),
                                    self.settings)
            try:
                obs.pods[name] = await self.kube.create(body)
            except KubeError as exc:
                if exc.status != 409:  # 409: the old Pod is still terminating; next pass
                    raise
                return None
            return Event("Normal", "CreatedPod", f"created Pod {name} ({pool}, settings {obs.pod_hashes[pool]})")

        missing = [name for name in desired if name not in obs.pods and name in obs.instances]
        events += filter(None, await self._each(missing, create))

    async def _prune(self, cluster: PDCluster, obs: Observation, built: set[str]) -> None:
        """Delete static objects no longer built (``desired.PRUNED``): engine files no Pod
        mounts any more, PodDisruptionBudgets of pools scaled to zero."""
        mounted = {v["configMap"]["name"] for pod in obs.pods.values()
                   for v in (pod.get("spec") or {}).get("volumes") or [] if "configMap" in v}
        ns = cluster.metadata.namespace
        for kind, component in PRUNED:
            for obj in await self.kube.list(kind, ns, b.selector(cluster, component)):
                if _name(obj) not in built and _name(obj) not in mounted and not _is_deleting(obj):
                    await self.kube.delete(kind, ns, _name(obj))

    async def _write_instance_statuses(self, cluster: PDCluster, obs: Observation,
                                       view: ControllerView | None) -> None:
        heartbeat = cluster.spec.heartbeat
        thresholds = (heartbeat.interval_seconds * heartbeat.suspect_after_missed,
                      heartbeat.interval_seconds * heartbeat.failed_after_missed)
        now = self.clock()
        writes = []
        for name, inst in obs.instances.items():
            have = inst.get("status") or {}
            want = build_instance_status(name, have, obs.pods.get(name), name in obs.draining,
                                         view.routable if view else None, thresholds,
                                         inst["metadata"].get("generation"), now)
            if not all(have.get(k) == v for k, v in want.items()):
                writes.append((name, inst, have, want))

        async def write(item) -> None:
            name, inst, have, want = item
            patched = await self.kube.patch("PDInstance", inst["metadata"]["namespace"], name,
                                            {"status": want}, subresource="status")
            obs.instances[name] = patched or {**inst, "status": {**have, **want}}

        await self._each(writes, write)

    async def _write_status(self, body: dict, status: dict) -> None:
        if is_subset(status, body.get("status") or {}):
            return
        meta = body["metadata"]
        await self.kube.patch("PDCluster", meta["namespace"], meta["name"], {"status": status},
                              subresource="status")

    async def finalize(self, body: dict) -> list[Event]:
        """Called by the delete handler (the finalizer holds the PDCluster until it returns):
        engines first, then the Controller forgets the cluster and the token Secret goes
        (a cluster recreated under the name gets its own); the GC removes the rest."""
        meta = body["metadata"]
        ns, name = meta["namespace"], meta["name"]
        async with self._locks[(ns, name)]:
            pods = await self.kube.list("Pod", ns, {b.CLUSTER_LABEL: name, b.COMPONENT_LABEL: "engine"})
            await self._each([_name(p) for p in pods if not _is_deleting(p)],
                             lambda pod: self.kube.delete("Pod", ns, pod))
            await self._each([_name(i) for i in await self.kube.list("PDInstance", ns, {b.CLUSTER_LABEL: name})],
                             lambda inst: self.kube.delete("PDInstance", ns, inst))
            left = await self.kube.list("Pod", ns, {b.CLUSTER_LABEL: name, b.COMPONENT_LABEL: "engine"})
            if left:
                raise NotYet(f"waiting for {len(left)} engine Pods to terminate")
            token = await self.cluster_token(ns, name, meta.get("uid"))
            try:
                num_keys = await self.controllers.for_cluster(name, ns, token).forget()
                event = Event("Normal", "Finalized", f"engines deleted; Controller forgot {num_keys} keys")
            except ControllerUnavailable as exc:
                since = datetime.fromisoformat(meta.get("deletionTimestamp") or self.clock().isoformat())
                if (self.clock() - since).total_seconds() < self.settings.forget_deadline_s:
                    raise NotYet(f"the Controller did not forget the cluster yet: {exc}") from None
                event = Event("Warning", "ControllerUnreachable",
                              f"Controller state may remain under /pdserve/{name}/: {exc}")
            finally:
                self._locks.pop((ns, name), None)
                await self.doctor.forget((ns, name))
            await self.controllers.close_cluster(name, ns)
            await self.kube.delete("Secret", ns, b.token_secret_name(name))
            return [event]
