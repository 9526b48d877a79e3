"""The control-plane controllers the operator and the tests rely on, small enough to read.

Each has ``sync()``, called every ``TICK_S`` from the cluster loop: level-triggered,
it reads the store (``Api.list``) and writes the difference over HTTP.

- ``DeploymentController``: a Deployment's Pods directly (no ReplicaSets), named
  ``<deployment>-<hash>-<xxxxx>``, labelled ``pod-template-hash``, owned by the
  Deployment (controller, blockOwnerDeletion). ``Recreate``: delete every old Pod,
  create new ones once no old Pod is left (terminating ones included).
  ``RollingUpdate`` (the default): maxSurge / maxUnavailable (int or percent; 25%
  each by default; surge rounds up, unavailable down): create new Pods while the
  total stays within replicas + maxSurge; delete unavailable old Pods first, then
  available ones while at least replicas - maxUnavailable stay available. Surplus
  Pods go not-ready first, newest first; Succeeded or Failed Pods are replaced.
  Available = Ready for minReadySeconds. Status: observedGeneration, replicas,
  updatedReplicas, readyReplicas, availableReplicas, unavailableReplicas (zeros
  omitted, as the API does), conditions Available and Progressing.
- ``EndpointsController``: a ``v1/Endpoints`` per Service with a selector: matching
  Pods with an IP, Ready ones as addresses, the others as notReadyAddresses (all
  as addresses with publishNotReadyAddresses; terminating Pods left out), named
  targetPorts resolved per Pod; then the ``ServiceProxy`` and the Pods' hosts files
  follow the Endpoints (selector-less Services keep the Endpoints someone wrote);
  then each Service's ``discovery.k8s.io/v1`` EndpointSlices (one per port set, the
  Service's labels plus ``kubernetes.io/service-name``, each endpoint's
  ``conditions.ready``; one empty slice when nothing matches) are written from its
  Endpoints, after the proxy follows them: whoever waits for a ready endpoint finds
  the Service routing.
- ``GarbageCollector``: an object whose every owner (ownerReferences, by uid) is gone
  is deleted (background); an owner deleted in the foreground (finalizer
  ``foregroundDeletion``) has its dependents deleted, and loses the finalizer when no
  dependent with blockOwnerDeletion is left; an owner deleted with ``Orphan`` has its
  references removed from its dependents, then loses the ``orphan`` finalizer.
- ``VolumeBinder``: every PersistentVolumeClaim is Bound at once (the kubelet gives
  it a directory).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from datetime import UTC, datetime

from tests.e2e.standin.api import (
    DEPLOYMENTS,
    ENDPOINTS,
    ENDPOINTSLICES,
    PODS,
    PVCS,
    SERVICES,
    Api,
    ApiError,
    is_deleting,
    meta,
)
from tests.e2e.standin.containers import now_rfc3339
from tests.e2e.standin.network import ServiceProxy

TICK_S = 0.2
HASH_LABEL = "pod-template-hash"
MANAGED_ANNOTATION = "standin.pdserve.io/managed-by"


def condition(obj: dict | None, type_: str) -> dict | None:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def is_pod_ready(pod: dict) -> bool:
    return (condition(pod, "Ready") or {}).get("status") == "True" and not is_deleting(pod)


def _age_s(timestamp: str | None) -> float:
    if not timestamp:
        return 0.0
    return (datetime.now(UTC) - datetime.fromisoformat(timestamp.replace("Z", "+00:00"))).total_seconds()


def template_hash(template: dict) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def scaled(value: int | str | None, replicas: int, default: str, round_up: bool) -> int:
    value = default if value is None else value
    if isinstance(value, str) and value.endswith("%"):
        exact = replicas * int(value[:-1]) / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


def _owned_by(obj: dict, uid: str) -> bool:
    return any(r.get("uid") == uid and r.get("controller") for r in meta(obj).get("ownerReferences") or [])


def _phase(pod: dict) -> str | None:
    return (pod.get("status") or {}).get("phase")


class DeploymentController:
    def __init__(self, api: Api) -> None:
        self.api = api

    async def sync(self) -> None:
        for deployment in self.api.list(DEPLOYMENTS):
            if not is_deleting(deployment):
                await self._sync(deployment)

    def _is_available(self, pod: dict, min_ready_s: float) -> bool:
        return is_pod_ready(pod) and _age_s((condition(pod, "Ready") or {}).get("lastTransitionTime")) >= min_ready_s

    async def _sync(self, d: dict) -> None:
        m, spec = meta(d), d.get("spec") or {}
        template, replicas = spec.get("template") or {}, spec.get("replicas", 1)
        current, min_ready_s = template_hash(template), spec.get("minReadySeconds", 0)
        owned = [p for p in self.api.list(PODS, m["namespace"]) if _owned_by(p, m["uid"])]
        for pod in owned:
            if _phase(pod) in ("Succeeded", "Failed") and not is_deleting(pod):
                await self._delete(pod)
        active = [p for p in owned if not is_deleting(p) and _phase(p) not in ("Succeeded", "Failed")]
        new = [p for p in active if meta(p).get("labels", {}).get(HASH_LABEL) == current]
        old = [p for p in active if p not in new]
        available = [p for p in active if self._is_available(p, min_ready_s)]
        strategy = spec.get("strategy") or {}
        if strategy.get("type", "RollingUpdate") == "Recreate":
            if old:
                for pod in old:
                    await self._delete(pod)
            elif not any(is_deleting(p) and meta(p).get("labels", {}).get(HASH_LABEL) != current for p in owned):
                await self._scale(d, new, replicas, current)
        else:
            rolling = strategy.get("rollingUpdate") or {}
            surge = scaled(rolling.get("maxSurge"), replicas, "25%", round_up=True)
            unavailable = scaled(rolling.get("maxUnavailable"), replicas, "25%", round_up=False)
            if surge == 0 and unavailable == 0:
                unavailable = 1
            if len(new) < replicas:
                for _ in range(max(0, min(replicas - len(new), replicas + surge - len(active)))):
                    await self._create(d, current)
            elif len(new) > replicas:
                await self._scale(d, new, replicas, current)
            if old:
                min_available = replicas - unavailable
                num_new_unavailable = sum(p not in available for p in new)
                room = len(active) - min_available - num_new_unavailable
                doomed = [p for p in old if p not in available][:max(0, room)]
                healthy = [p for p in old if p in available]
                doomed += healthy[:max(0, len(available) - min_available)]
                for pod in doomed:
                    await self._delete(pod)
        await self._write_status(d, active, new, available, replicas, current)

    async def _scale(self, d: dict, pods: list[dict], replicas: int, current: str) -> None:
        for _ in range(replicas - len(pods)):
            await self._create(d, current)
        surplus = sorted(pods, key=lambda p: (is_pod_ready(p), meta(p).get("creationTimestamp", "")),
                         reverse=False)
        surplus = sorted(surplus, key=is_pod_ready)[:max(0, len(pods) - replicas)]
        for pod in surplus:
            await self._delete(pod)

    async def _create(self, d: dict, current: str) -> None:
        m, template = meta(d), copy.deepcopy((d.get("spec") or {}).get("template") or {})
        tmeta = template.get("metadata") or {}
        await self.api.create(PODS, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": f"{m['name']}-{current}-", "namespace": m["namespace"],
                         "labels": {**(tmeta.get("labels") or {}), HASH_LABEL: current},
                         "annotations": tmeta.get("annotations") or {},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": m["name"],
                                              "uid": m["uid"], "controller": True, "blockOwnerDeletion": True}]},
            "spec": template.get("spec") or {}})

    async def _delete(self, pod: dict) -> None:
        await self.api.delete(PODS, meta(pod)["namespace"], meta(pod)["name"])

    async def _write_status(self, d: dict, active, new, available, replicas: int, current: str) -> None:
        m, old_status = meta(d), d.get("status") or {}
        unavailable = scaled(((d.get("spec") or {}).get("strategy") or {}).get("rollingUpdate", {}).get(
            "maxUnavailable"), replicas, "25%", round_up=False)
        is_complete = len(new) == replicas == len(active) and all(p in available for p in new)
        conditions = [
            ("Available", len(available) >= replicas - unavailable,
             "MinimumReplicasAvailable" if len(available) >= replicas - unavailable else "MinimumReplicasUnavailable"),
            ("Progressing", True, "NewReplicaSetAvailable" if is_complete else "ReplicaSetUpdated")]
        status = {k: v for k, v in {
            "observedGeneration": m.get("generation"), "replicas": len(active), "updatedReplicas": len(new),
            "readyReplicas": sum(is_pod_ready(p) for p in active), "availableReplicas": len(available),
            "unavailableReplicas": max(0, replicas - len(available))}.items() if v}
        status["conditions"] = []
        for type_, is_true, reason in conditions:
            was = condition(d, type_) or {}
            value = "True" if is_true else "False"
            status["conditions"].append({
                "type": type_, "status": value, "reason": reason,
                "lastTransitionTime": was.get("lastTransitionTime") if was.get("status") == value else now_rfc3339(),
                "lastUpdateTime": was.get("lastUpdateTime") if was.get("reason") == reason else now_rfc3339()})
        if status != old_status:
            await self.api.patch(DEPLOYMENTS, m["namespace"], m["name"], {"status": status}, subresource="status")


def _target_port(pod: dict, port: dict) -> int | None:
    target = port.get("targetPort", port.get("port"))
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == target:
                return int(p["containerPort"])
    return None


def build_subsets(service: dict, pods: list[dict]) -> list[dict]:
    spec, name = service.get("spec") or {}, meta(service)["name"]
    groups: dict[tuple, dict] = {}
    for pod in sorted(pods, key=lambda p: meta(p)["name"]):
        ports = tuple((p.get("name"), _target_port(pod, p), p.get("protocol", "TCP")) for p in spec.get("ports") or [])
        if any(port is None for _, port, _ in ports):
            continue
        pod_spec = pod.get("spec") or {}
        address = {"ip": pod["status"]["podIP"], "nodeName": pod_spec.get("nodeName"),
                   "targetRef": {"kind": "Pod", "name": meta(pod)["name"], "namespace": meta(pod)["namespace"],
                                 "uid": meta(pod)["uid"]}}
        if pod_spec.get("hostname") and pod_spec.get("subdomain") == name:
            address["hostname"] = pod_spec["hostname"]
        subset = groups.setdefault(ports, {"ports": [{k: v for k, v in (("name", n), ("port", p), ("protocol", t))
                                                      if v is not None} for n, p, t in ports]})
        ready = is_pod_ready(pod) or spec.get("publishNotReadyAddresses")
        subset.setdefault("addresses" if ready else "notReadyAddresses", []).append(address)
    return list(groups.values())


def build_slice(service: dict, subset: dict, name: str) -> dict:
    """EndpointSlice ``name`` of one of ``service``'s Endpoints subsets."""
    def endpoint(address: dict, ready: bool) -> dict:
        out = {"addresses": [address["ip"]], "conditions": {"ready": ready, "serving": ready,
                                                              "terminating": False}}
        out.update({k: address[k] for k in ("nodeName", "targetRef", "hostname") if address.get(k)})
        return out

    m = meta(service)
    labels = {**(m.get("labels") or {}), "kubernetes.io/service-name": m["name"],
              "endpointslice.kubernetes.io/managed-by": "standin"}
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": m["namespace"], "labels": labels,
                         "annotations": {MANAGED_ANNOTATION: "endpointslice-controller"}},
            "addressType": "IPv4",
            "endpoints": [endpoint(a, True) for a in subset.get("addresses") or []]
            + [endpoint(a, False) for a in subset.get("notReadyAddresses") or []],
            "ports": subset.get("ports") or []}


class EndpointsController:
    def __init__(self, api: Api, proxy: ServiceProxy) -> None:
        self.api, self.proxy = api, proxy

    async def sync(self) -> None:
        services = self.api.list(SERVICES)
        names = {(meta(s)["namespace"], meta(s)["name"]) for s in services}
        for svc in services:
            selector = (svc.get("spec") or {}).get("selector")
            if selector:
                await self._sync(svc, selector)
        for ep in self.api.list(ENDPOINTS):
            key = (meta(ep)["namespace"], meta(ep)["name"])
            if key not in names and (meta(ep).get("annotations") or {}).get(MANAGED_ANNOTATION):
                await self.api.delete(ENDPOINTS, *key)
        endpoints = {(meta(e)["namespace"], meta(e)["name"]): e for e in self.api.list(ENDPOINTS)}
        await self.proxy.sync(services, endpoints)
        await self._sync_slices(services, endpoints)

    async def _sync_slices(self, services: list[dict], endpoints: dict[tuple[str, str], dict]) -> None:
        wanted: dict[tuple[str, str], dict] = {}
        for svc in services:
            m = meta(svc)
            ep = endpoints.get((m["namespace"], m["name"]))
            if ep is not None:  # no subset: one slice without endpoints, as the API keeps
                for i, subset in enumerate(ep.get("subsets") or [{}]):
                    name = f"{m['name']}-{i}"
                    wanted[(m["namespace"], name)] = build_slice(svc, subset, name)
        for s in self.api.list(ENDPOINTSLICES):
            key = (meta(s)["namespace"], meta(s)["name"])
            if key not in wanted and (meta(s).get("annotations") or {}).get(MANAGED_ANNOTATION):
                await self.api.delete(ENDPOINTSLICES, *key)
        for (ns, name), wanted_slice in wanted.items():
            existing = self.api.get(ENDPOINTSLICES, ns, name)
            if existing is None:
                await self.api.create(ENDPOINTSLICES, wanted_slice)
            elif any(existing.get(k) != wanted_slice[k] for k in ("endpoints", "ports")):
                await self.api.patch(ENDPOINTSLICES, ns, name, {k: wanted_slice[k] for k in ("endpoints", "ports")})

    async def _sync(self, svc: dict, selector: dict) -> None:
        m = meta(svc)
        pods = [p for p in self.api.list(PODS, m["namespace"])
                if all((meta(p).get("labels") or {}).get(k) == v for k, v in selector.items())
                and (p.get("status") or {}).get("podIP") and not is_deleting(p)
                and _phase(p) not in ("Succeeded", "Failed")]
        subsets = build_subsets(svc, pods)
        existing = self.api.get(ENDPOINTS, m["namespace"], m["name"])
        if existing is None:
            await self.api.create(ENDPOINTS, {
                "apiVersion": "v1", "kind": "Endpoints",
                "metadata": {"name": m["name"], "namespace": m["namespace"], "labels": m.get("labels") or {},
                             "annotations": {MANAGED_ANNOTATION: "endpoints-controller"}},
                "subsets": subsets})
        elif (existing.get("subsets") or []) != subsets:
            await self.api.patch(ENDPOINTS, m["namespace"], m["name"], {"subsets": subsets})


class GarbageCollector:
    def __init__(self, api: Api) -> None:
        self.api = api

    async def sync(self) -> None:
        uids = self.api.uids()
        for resource, obj in list(uids.values()):
            refs = meta(obj).get("ownerReferences") or []
            if not refs:
                continue
            owners = [uids.get(r.get("uid")) for r in refs]
            try:
                if all(o is None for o in owners):
                    if not is_deleting(obj):
                        await self._delete(resource, obj, "Background")
                    continue
                for ref, owner in zip(refs, owners, strict=True):
                    finalizers = meta(owner[1]).get("finalizers") or [] if owner else []
                    if owner and is_deleting(owner[1]) and "foregroundDeletion" in finalizers \
                            and not is_deleting(obj):
                        await self._delete(resource, obj, "Foreground")
                    elif owner and is_deleting(owner[1]) and "orphan" in finalizers:
                        await self._patch(resource, obj, {"ownerReferences": [
                            r for r in refs if r.get("uid") != ref.get("uid")]})
            except ApiError as exc:
                if exc.status != 409:  # 409: changed meanwhile; the next pass sees it
                    raise
        for resource, obj in list(uids.values()):
            finalizers = meta(obj).get("finalizers") or []
            if not is_deleting(obj) or not {"foregroundDeletion", "orphan"} & set(finalizers):
                continue
            uid = meta(obj)["uid"]
            dependents = [d for _, d in uids.values()
                          for r in meta(d).get("ownerReferences") or [] if r.get("uid") == uid]
            blocking = [d for d in dependents if any(r.get("uid") == uid and r.get("blockOwnerDeletion")
                                                     for r in meta(d).get("ownerReferences") or [])]
            done = {"foregroundDeletion"} if not blocking else set()
            done |= {"orphan"} if not dependents else set()
            if done & set(finalizers):
                try:
                    await self._patch(resource, obj, {"finalizers": [f for f in finalizers if f not in done]})
                except ApiError as exc:
                    if exc.status != 409:
                        raise

    async def _delete(self, resource, obj: dict, propagation: str) -> None:
        await self.api.delete(resource, meta(obj).get("namespace"), meta(obj)["name"], propagation=propagation)

    async def _patch(self, resource, obj: dict, metadata: dict) -> None:
        m = meta(obj)
        await self.api.patch(resource, m.get("namespace"), m["name"],
                             {"metadata": {**metadata, "resourceVersion": m["resourceVersion"]}})


class VolumeBinder:
    def __init__(self, api: Api) -> None:
        self.api = api

    async def sync(self) -> None:
        for pvc in self.api.list(PVCS):
            if (pvc.get("status") or {}).get("phase") != "Bound":
                spec = pvc.get("spec") or {}
                await self.api.patch(PVCS, meta(pvc)["namespace"], meta(pvc)["name"], {"status": {
                    "phase": "Bound", "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                    "capacity": ((spec.get("resources") or {}).get("requests") or {})}}, subresource="status")
