"""A stricter Kubernetes emulator for operator tests, on top of ``kmock`` (pinned: 0.8).

kmock's ``KubernetesEmulator`` stores bodies verbatim. This subclass adds what
kopf and the operator rely on from a real apiserver:

- server metadata on create (uid, resourceVersion, generation, creationTimestamp,
  namespace, a name from ``generateName``); 409 when the name is taken;
- a resourceVersion bumped on every change (not on no-op patches), a generation
  bumped on spec changes, 409 on a stale ``metadata.resourceVersion`` in a merge
  patch, JSON patches with ``test`` ops answered 422 on mismatch (kopf's
  finalizer writes rely on it);
- status-subresource separation for resources declared with ``status``;
- finalizers: delete marks ``deletionTimestamp``; the object goes when the last
  finalizer is removed;
- label selectors on list and watch; watch snapshot and subscription made atomic
  (no write is lost between them);
- Kubernetes requests answered directly, not through kmock's reaction matching,
  which scans the whole request history on every request (quadratic over a test).

No garbage collector, no kubelet, no controllers: the tests play them.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import json
import uuid

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import enums

RESOURCES = {
    "v1/pods": kmock.ResourceInfo(kind="Pod", namespaced=True, subresources={"status"}),
    "v1/services": kmock.ResourceInfo(kind="Service", namespaced=True, subresources={"status"}),
    "v1/configmaps": kmock.ResourceInfo(kind="ConfigMap", namespaced=True),
    "v1/serviceaccounts": kmock.ResourceInfo(kind="ServiceAccount", namespaced=True),
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True),
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", namespaced=False),
    "apps/v1/deployments": kmock.ResourceInfo(kind="Deployment", namespaced=True, subresources={"status"}),
    "rbac.authorization.k8s.io/v1/rolebindings": kmock.ResourceInfo(kind="RoleBinding", namespaced=True),
    "pdserve.io/v1alpha1/pdclusters": kmock.ResourceInfo(
        kind="PDCluster", namespaced=True, subresources={"status"}, shortnames={"pdc"}),
    "pdserve.io/v1alpha1/pdinstances": kmock.ResourceInfo(
        kind="PDInstance", namespaced=True, subresources={"status"}, shortnames={"pdi"}),
}
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


def merge_patch(target: object, patch: object) -> object:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def matches_selector(labels: dict, selector: str | None) -> bool:
    """Equality- and existence-based label selectors (``a=b,c!=d,e,!f``)."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            ok = labels.get(key.strip()) != value.strip()
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            ok = labels.get(key.strip()) == value.strip()
        elif term.startswith("!"):
            ok = term[1:].strip() not in labels
        else:
            ok = term in labels
        if not ok:
            return False
    return True


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _status(code: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=code, reason=reason, message=message, details={})


@attrs.define(kw_only=True)
class StrictEmulator(kmock.KubernetesEmulator):
    _versions: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, info in RESOURCES.items():
            info.verbs = set(VERBS)
            self.resources[key] = info

    def _has_status(self, resource) -> bool:
        info = self.resources.get(resource) if hasattr(self.resources, "get") else None
        return bool(info and "status" in info.subresources)

    def _bump(self, body: dict) -> None:
        body.setdefault("metadata", {})["resourceVersion"] = str(next(self._versions))

    async def _handle(self, request):
        action = request.action
        if action is None or getattr(request.resource, "plural", None) is None:  # discovery
            return await super(kmock.KubernetesEmulator, self)._handle(request)
        if action == enums.action.WATCH:
            return await self._stream(request)
        if action == enums.action.LIST:
            return aiohttp.web.json_response(await self._serve_list(request))
        if action == enums.action.FETCH:
            return aiohttp.web.json_response(await self._serve_fetch(request))
        async with self._lock:
            if action == enums.action.CREATE:
                body = await self._create(request)
            elif action == enums.action.UPDATE:
                body = await self._update(request)
            else:
                body = await self._delete(request)
        return aiohttp.web.json_response(body)

    async def _stream(self, request) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        async for event in self._serve_watch(request):
            if event != b"":
                await response.write(json.dumps(event).encode() + b"\n")
        return response

    async def _create(self, request) -> dict:
        body = request.data
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace:
            meta["namespace"] = request.namespace
        key = (request.resource, meta.get("namespace"), meta.get("name"))
        if key in self.objects and not self.objects[key].deleted:
            raise _status(409, "AlreadyExists", f"{meta.get('name')} already exists")
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now())
        self._bump(body)
        if key in self.objects:
            self.objects[key].create(body)
        else:
            self.objects[key] = body
        await self._buses[request.resource].put({"type": "ADDED", "object": copy.deepcopy(body)})
        return body

    def _existing(self, request) -> tuple:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise _status(404, "NotFound", f"{request.name} not found")
        return key, copy.deepcopy(self.objects[key].raw)

    async def _update(self, request) -> dict:
        key, old = self._existing(request)
        if isinstance(request.data, list):  # application/json-patch+json
            try:
                new = jsonpatch.apply_patch(old, request.data)
            except (jsonpatch.JsonPatchConflict, jsonpatch.JsonPatchTestFailed) as exc:
                raise _status(422, "Invalid", f"the JSON patch does not apply: {exc}") from None
        else:
            wanted_rv = (request.data.get("metadata") or {}).get("resourceVersion")
            if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
                raise _status(409, "Conflict", "the object has been modified")
            new = merge_patch(old, request.data)
        if self._has_status(request.resource):
            if request.subresource == "status":
                new = {**old, "status": new.get("status")}
            elif "status" in old:
                new["status"] = old["status"]
            else:
                new.pop("status", None)
        new["metadata"] = {**new["metadata"], "resourceVersion": old["metadata"]["resourceVersion"],
                           "uid": old["metadata"]["uid"]}
        if new == old:
            return old
        if new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        self._bump(new)
        await self._store(key, request.resource, new)
        return new

    async def _delete(self, request) -> dict:
        key, old = self._existing(request)
        if old["metadata"].get("finalizers"):
            if not old["metadata"].get("deletionTimestamp"):
                old["metadata"]["deletionTimestamp"] = _now()
                self._bump(old)
                await self._store(key, request.resource, old)
            return old
        self._bump(old)
        self.objects[key].create(old)
        self.objects[key].delete()
        await self._buses[request.resource].put({"type": "DELETED", "object": old})
        return old

    async def _store(self, key, resource, new: dict) -> None:
        meta = new["metadata"]
        self.objects[key].create(new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self.objects[key].delete()
            await self._buses[resource].put({"type": "DELETED", "object": copy.deepcopy(new)})
        else:
            await self._buses[resource].put({"type": "MODIFIED", "object": copy.deepcopy(new)})

    async def _serve_list(self, request):
        result = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        result["items"] = [i for i in result["items"]
                           if matches_selector((i.get("metadata") or {}).get("labels") or {}, selector)]
        result["metadata"] = {"resourceVersion": str(next(self._versions))}
        return result

    async def _serve_watch(self, request):
        yield b""
        selector = request.params.get("labelSelector")
        bus = self._buses[request.resource]
        async with self._lock:  # writes hold this lock too: nothing slips in between
            mark = await bus.mark()
            objs = [o.raw for o in self._KubernetesEmulator__get_objs(request, strict=False)
                    if not o.deleted]
        try:
            for obj in objs:
                if matches_selector(obj["metadata"].get("labels") or {}, selector):
                    yield {"type": "ADDED", "object": obj}
            async for event in mark:
                obj = event.get("object", {})
                meta = obj.get("metadata", {})
                if (self._KubernetesEmulator__check(request, request.resource, meta.get("namespace"),
                                                    meta.get("name"), strict=False)
                        and matches_selector(meta.get("labels") or {}, selector)):
                    yield event
        finally:
            await bus.unmark(mark)
