"""Reconcile one PDCluster: observe, build the desired objects, apply the difference,
write status. Level-triggered: it reads everything each time and keeps no state
between calls except per-cluster locks, so running it again changes nothing.

Order of a pass: cluster file, control-plane objects and Services
(``_apply_static``); PDInstances (``_create_instances``; ``_scale_down``: drain
surplus, then delete); the Controller's replacement requests
(``_apply_replacements``: delete the Pod, acknowledge); engine Pods
(``_apply_engine_pods``, the one place that creates Pods, built by
``pods.build_engine_pod``: roll, recreate failed, create missing); PDInstance
phases; PDCluster status.

Rollout of engine settings (why "recreate"): a P and a D with different engine
settings must never be paired, so Pods of two settings hashes never run at the
same time. When the hash changes every old Pod is deleted first, and no new Pod
is created while any old Pod is still listed (terminating ones included). The
price is a short outage of the engines; the PDInstances and the control plane stay.

Invariants: only ``kube.KubeClient`` touches the API; a Controller that does not
answer never stops the pass (drains wait for their deadline instead); an instance
is deleted only after the Controller says it is drained, or its drain deadline
passed, or its Pod is not running (nothing to drain).
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from datetime import UTC, datetime

from pdserve.api import PDCluster
from pdserve.api.manifest import ManifestError, parse_manifest
from pdserve.operator import builders as b
from pdserve.operator.controller_client import (
    ControllerClient,
    ControllerClients,
    ControllerUnavailable,
)
from pdserve.operator.deployments import build_controller_deployment, build_coordinator_deployment
from pdserve.operator.kube import KubeClient, KubeError, is_subset
from pdserve.operator.pods import build_engine_pod
from pdserve.operator.settings import OperatorSettings
from pdserve.operator.status import (
    Observation,
    build_invalid_status,
    build_status,
    instance_phase,
    is_available,
)


class InvalidSpec(Exception):
    """The spec cannot be reconciled; the message names each bad field."""


class NotYet(Exception):
    """A step waits for something outside the operator (Pods terminating, the Controller)."""


@dataclass(frozen=True)
class Event:
    type: str      # Normal | Warning
    reason: str
    message: str


def _name(obj: dict) -> str:
    return obj["metadata"]["name"]


def _is_deleting(obj: dict | None) -> bool:
    return bool(obj and obj["metadata"].get("deletionTimestamp"))


def _phase(pod: dict | None) -> str | None:
    return ((pod or {}).get("status") or {}).get("phase")


class Reconciler:
    """Called by the kopf handlers; one per operator process."""

    def __init__(self, kube: KubeClient, controllers: ControllerClients, settings: OperatorSettings,
                 clock=lambda: datetime.now(UTC)) -> None:
        self.kube, self.controllers, self.settings, self.clock = kube, controllers, settings, clock
        self._locks: dict[tuple[str, str], asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._queued: set[tuple[str, str]] = set()

    def parse(self, body: dict) -> PDCluster:
        meta = body["metadata"]
        raw = {**body, "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "generation")}}
        try:
            return parse_manifest(raw, PDCluster, f"PDCluster {meta.get('namespace')}/{meta['name']}")
        except ManifestError as exc:
            raise InvalidSpec("; ".join(exc.problems)) from None

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

    async def _reconcile(self, body: dict) -> list[Event]:
        generation = body["metadata"].get("generation")
        try:
            cluster = self.parse(body)
        except InvalidSpec as exc:
            await self._write_status(body, build_invalid_status(generation, body.get("status"),
                                                                str(exc), self.clock()))
            raise
        events: list[Event] = []
        ns, name = cluster.metadata.namespace, cluster.metadata.name
        obs = Observation()
        obs.deployments = await self._apply_static(cluster, events)
        obs.instances = {_name(i): i for i in await self.kube.list("PDInstance", ns, {b.CLUSTER_LABEL: name})}
        obs.pods = {_name(p): p for p in await self.kube.list("Pod", ns, b.selector(cluster, "engine"))}
        # no call to a Controller that has no available replica (it would only time out)
        ctrl = (self.controllers.for_cluster(name, ns)
                if is_available(obs.deployments.get("controller")) else None)
        await self._create_instances(cluster, obs, events)
        await self._scale_down(cluster, obs, ctrl, events)
        await self._apply_replacements(cluster, obs, ctrl, events)
        await self._apply_engine_pods(cluster, obs, events)
        try:
            obs.controller_mode = await ctrl.mode() if ctrl else None
        except ControllerUnavailable:
            obs.controller_mode = None
        await self._write_instance_phases(obs)
        await self._write_status(body, build_status(cluster, generation, body.get("status"), obs,
                                                    self.clock()))
        return events

    async def _apply_static(self, cluster: PDCluster, events: list[Event]) -> dict[str, dict | None]:
        objects = [b.build_config_map(cluster),
                   *b.build_controlplane_rbac(cluster, self.settings.controlplane_clusterrole),
                   *b.build_services(cluster),
                   build_controller_deployment(cluster, self.settings),
                   build_coordinator_deployment(cluster, self.settings)]
        deployments = {}
        for obj in objects:
            result, observed = await self.kube.apply(obj)
            if result != "unchanged":
                events.append(Event("Normal", result.capitalize(), f"{result} {obj['kind']} {_name(obj)}"))
            if obj["kind"] == "Deployment":
                deployments[obj["spec"]["template"]["metadata"]["labels"][b.COMPONENT_LABEL]] = observed
        return deployments

    async def _create_instances(self, cluster: PDCluster, obs: Observation, events: list[Event]) -> None:
        for name, (pool, ordinal) in b.desired_instances(cluster).items():
            inst = obs.instances.get(name)
            if inst is None:
                obs.instances[name] = await self.kube.create(b.build_instance(cluster, pool, ordinal))
                events.append(Event("Normal", "CreatedInstance", f"created PDInstance {name}"))
            elif b.DRAIN_ANNOTATION in (inst["metadata"].get("annotations") or {}):
                # scaled back up while draining: its engine stopped admitting, start it afresh
                patch = {"metadata": {"annotations": {b.DRAIN_ANNOTATION: None}}}
                obs.instances[name] = await self.kube.patch("PDInstance", cluster.metadata.namespace,
                                                            name, patch) or inst
                if name in obs.pods and await self.kube.delete("Pod", cluster.metadata.namespace, name):
                    obs.pods.pop(name)
                events.append(Event("Normal", "DrainCancelled", f"{name} is wanted again; Pod restarted"))

    async def _scale_down(self, cluster: PDCluster, obs: Observation, ctrl: ControllerClient | None,
                          events: list[Event]) -> None:
        desired = b.desired_instances(cluster)
        now = self.clock().timestamp()
        deadline_s = self.settings.drain_deadline_s
        for name, inst in list(obs.instances.items()):
            if name in desired:
                continue
            pod = obs.pods.get(name)
            if _phase(pod) != "Running" or _is_deleting(pod):
                await self._delete_instance(cluster, obs, name)
                events.append(Event("Normal", "DeletedInstance", f"deleted {name} (scaled down; not running)"))
                continue
            started = (inst["metadata"].get("annotations") or {}).get(b.DRAIN_ANNOTATION)
            if started is None:
                started = f"{now:.3f}"
                await self.kube.patch("PDInstance", cluster.metadata.namespace, name,
                                      {"metadata": {"annotations": {b.DRAIN_ANNOTATION: started}}})
                events.append(Event("Normal", "Draining", f"draining {name} before deleting it "
                                                          f"(deadline {deadline_s:g}s)"))
            try:
                is_drained = bool(ctrl) and (await ctrl.drain(name, deadline_s)).is_drained
            except ControllerUnavailable:
                is_drained = False
            if is_drained or now - float(started) >= deadline_s:
                await self._delete_instance(cluster, obs, name)
                reason, why = ("DeletedInstance", "drained") if is_drained else ("DrainTimeout", "drain deadline passed")
                events.append(Event("Normal" if is_drained else "Warning", reason, f"deleted {name} ({why})"))
            else:
                obs.draining.append(name)

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

    async def _apply_engine_pods(self, cluster: PDCluster, obs: Observation, events: list[Event]) -> None:
        """Engine Pods: with stale settings, delete them all and create none this pass;
        else recreate failed ones and create each missing one from ``build_engine_pod``."""
        ns, spec_hash = cluster.metadata.namespace, b.engine_spec_hash(cluster)
        stale = [p for p in obs.pods.values() if p["metadata"]["labels"].get(b.SPEC_HASH_LABEL) != spec_hash]
        obs.num_stale_pods = len(stale)
        if stale:
            doomed = [_name(p) for p in stale if not _is_deleting(p)]
            for name in doomed:
                await self.kube.delete("Pod", ns, name)
            if doomed:
                events.append(Event("Normal", "RollingEngines",
                                    f"engine settings changed (now {spec_hash}): deleting "
                                    + ", ".join(sorted(doomed)) + " before starting new Pods"))
            return
        for name, (pool, _) in b.desired_instances(cluster).items():
            pod = obs.pods.get(name)
            if pod is not None and _phase(pod) in ("Failed", "Succeeded") and not _is_deleting(pod):
                await self.kube.delete("Pod", ns, name)
                obs.pods.pop(name)
                events.append(Event("Warning", "PodFailed", f"Pod {name} {_phase(pod)}; recreating it"))
            elif pod is not None or name not in obs.instances:
                continue
            body = build_engine_pod(cluster, name, pool, obs.instances[name]["metadata"].get("uid"),
                                    self.settings.image)
            try:
                obs.pods[name] = await self.kube.create(body)
            except KubeError as exc:
                if exc.status != 409:  # 409: the old Pod is still terminating; next pass
                    raise
                continue
            events.append(Event("Normal", "CreatedPod", f"created Pod {name} ({pool}, settings {spec_hash})"))

    async def _write_instance_phases(self, obs: Observation) -> None:
        for name, inst in obs.instances.items():
            pod = obs.pods.get(name)
            want = {"phase": instance_phase(pod, name in obs.draining), "pod": name if pod else None}
            have = inst.get("status") or {}
            if any(have.get(k) != v for k, v in want.items()):
                await self.kube.patch("PDInstance", inst["metadata"]["namespace"], name,
                                      {"status": want}, subresource="status")

    async def _write_status(self, body: dict, status: dict) -> None:
        if is_subset(status, body.get("status") or {}):
            return
        meta = body["metadata"]
        await self.kube.patch("PDCluster", meta["namespace"], meta["name"], {"status": status},
                              subresource="status")

    async def finalize(self, body: dict) -> list[Event]:
        """Called by the delete handler (the finalizer holds the PDCluster until it returns):
        engines first, then the Controller forgets the cluster; the GC removes the rest."""
        meta = body["metadata"]
        ns, name = meta["namespace"], meta["name"]
        async with self._locks[(ns, name)]:
            pods = await self.kube.list("Pod", ns, {b.CLUSTER_LABEL: name, b.COMPONENT_LABEL: "engine"})
            for pod in pods:
                if not _is_deleting(pod):
                    await self.kube.delete("Pod", ns, _name(pod))
            for inst in await self.kube.list("PDInstance", ns, {b.CLUSTER_LABEL: name}):
                await self.kube.delete("PDInstance", ns, _name(inst))
            left = await self.kube.list("Pod", ns, {b.CLUSTER_LABEL: name, b.COMPONENT_LABEL: "engine"})
            if left:
                raise NotYet(f"waiting for {len(left)} engine Pods to terminate")
            try:
                num_keys = await self.controllers.for_cluster(name, ns).forget()
            except ControllerUnavailable as exc:
                since = datetime.fromisoformat(meta.get("deletionTimestamp") or self.clock().isoformat())
                if (self.clock() - since).total_seconds() < self.settings.forget_deadline_s:
                    raise NotYet(f"the Controller did not forget the cluster yet: {exc}") from None
                return [Event("Warning", "ControllerUnreachable",
                              f"Controller state may remain under /pdserve/{name}/: {exc}")]
            finally:
                self._locks.pop((ns, name), None)
            await self.controllers.close_cluster(name, ns)
            return [Event("Normal", "Finalized", f"engines deleted; Controller forgot {num_keys} keys")]
