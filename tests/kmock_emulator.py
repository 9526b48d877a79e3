"""A stricter Kubernetes API emulator on top of ``kmock`` (pinned: 0.8), for the operator
tests and the one-machine cluster stand-in (``tests/e2e/standin``).

kmock's ``KubernetesEmulator`` stores bodies verbatim. This subclass adds what kopf,
the operator and the stand-in's kubelet and controllers rely on from a real apiserver:

- objects: server metadata on create (uid, resourceVersion, generation,
  creationTimestamp, namespace, a name from ``generateName``); 409 when the name is
  taken; 404 for a resource nobody declared; 422 for an ownerReference without uid;
- versions: a resourceVersion bumped on every change (not on no-op patches), a
  generation bumped on spec changes, 409 on a stale ``metadata.resourceVersion`` in a
  merge patch or a PUT, JSON patches with ``test`` ops answered 422 on mismatch
  (kopf's finalizer writes rely on it); PUT replaces, PATCH merges;
- status-subresource separation for resources declared with ``status``;
- admission: defaults first (a Service gets a ``clusterIP`` from ``service_ips`` unless
  headless or ExternalName, ``type``, and each port ``protocol`` and ``targetPort``; a Secret's
  ``stringData`` is folded into ``data``), then validation, answered 422 with every
  problem: object names (DNS-1123 subdomain; Services DNS-1035 and Namespaces
  DNS-1123 labels, 63 characters), label keys and values (63 characters, the label
  alphabet), a Pod's hostname and subdomain, container and port names, immutable
  fields on update (a Pod's spec except images, deadlines and tolerations; a
  Deployment's selector; a Service's clusterIP);
- CRDs: creating a CustomResourceDefinition serves its resources (discovery, status
  subresource, short names); its ``openAPIV3Schema`` prunes unknown fields and fills
  defaults, as a structural schema does (no other validation); deleting it removes
  its objects. ``with_pdserve_crds`` (default: on, for the operator tests) serves
  PDCluster and PDInstance without a CRD;
- deletion: finalizers hold an object (``deletionTimestamp``) until the last one goes;
  ``propagationPolicy`` (query or DeleteOptions body) ``Foreground`` / ``Orphan`` add
  the ``foregroundDeletion`` / ``orphan`` finalizer for a garbage collector to act on,
  ``Background`` (the default) removes the object at once; a Pod bound to a node
  (``spec.nodeName``) is deleted gracefully: marked (``deletionTimestamp`` = now +
  grace, ``deletionGracePeriodSeconds``) until its kubelet deletes it again with
  ``gracePeriodSeconds=0``. Unbound Pods go at once, as on a real cluster;
- ``POST pods/NAME/binding`` sets ``spec.nodeName`` (the scheduler's call);
  ``GET pods/NAME/log`` answers from ``pod_logs`` when a kubelet provides it;
  Namespace objects are served (kmock alone reads ``/api/v1/namespaces/NAME`` as a
  path prefix);
- reads: label selectors (equality and existence) and field selectors (any dotted
  path; ``=``, ``==``, ``!=``; a missing field reads as "") on list and watch; watch
  snapshot and subscription made atomic (no write is lost between them); a watch ends
  after ``timeoutSeconds``;
- Kubernetes requests answered directly, not through kmock's reaction matching,
  which scans the whole request history on every request (quadratic over a test).

Not emulated: authentication and authorization, admission beyond the above, CEL and
type validation, strategic merge patches (applied as merge patches),
server-side apply, watches from a resourceVersion (a watch replays the current
objects as ADDED), namespace lifecycle. No garbage collector, kubelet or
controllers: the operator tests play them, the e2e stand-in runs them. One module on
purpose (past 500 lines): it is the whole apiserver surface the tests rely on.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import itertools
import json
import re
import uuid
from collections.abc import Callable, Iterator

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import enums, parsing

RESOURCES = {  # served resources: (kind, singular, short names, namespaced, subresources)
    f"{prefix}/{plural}": kmock.ResourceInfo(kind=kind, singular=singular, shortnames=set(short),
                                              namespaced=namespaced, subresources=set(subresources))
    for prefix, plural, kind, singular, short, namespaced, subresources in (
        ("v1", "pods", "Pod", "pod", ["po"], True, ["status", "binding", "log"]),
        ("v1", "services", "Service", "service", ["svc"], True, ["status"]),
        ("v1", "endpoints", "Endpoints", "endpoints", ["ep"], True, []),
        ("discovery.k8s.io/v1", "endpointslices", "EndpointSlice", "endpointslice", [], True, []),
        ("v1", "configmaps", "ConfigMap", "configmap", ["cm"], True, []),
        ("v1", "secrets", "Secret", "secret", [], True, []),
        ("v1", "persistentvolumeclaims", "PersistentVolumeClaim", "persistentvolumeclaim", ["pvc"], True,
         ["status"]),
        ("v1", "serviceaccounts", "ServiceAccount", "serviceaccount", ["sa"], True, []),
        ("v1", "events", "Event", "event", ["ev"], True, []),
        ("v1", "namespaces", "Namespace", "namespace", ["ns"], False, ["status"]),
        ("v1", "nodes", "Node", "node", ["no"], False, ["status"]),
        ("apps/v1", "deployments", "Deployment", "deployment", ["deploy"], True, ["status"]),
        ("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", "poddisruptionbudget", ["pdb"], True,
         ["status"]),
        ("rbac.authorization.k8s.io/v1", "roles", "Role", "role", [], True, []),
        ("rbac.authorization.k8s.io/v1", "rolebindings", "RoleBinding", "rolebinding", [], True, []),
        ("rbac.authorization.k8s.io/v1", "clusterroles", "ClusterRole", "clusterrole", [], False, []),
        ("rbac.authorization.k8s.io/v1", "clusterrolebindings", "ClusterRoleBinding", "clusterrolebinding", [],
         False, []),
        ("apiextensions.k8s.io/v1", "customresourcedefinitions", "CustomResourceDefinition",
         "customresourcedefinition", ["crd", "crds"], False, ["status"]),
    )
}
PDSERVE_RESOURCES = {
    "pdserve.io/v1alpha1/pdclusters": kmock.ResourceInfo(
        kind="PDCluster", singular="pdcluster", namespaced=True, subresources={"status"}, shortnames={"pdc"}),
    "pdserve.io/v1alpha1/pdinstances": kmock.ResourceInfo(
        kind="PDInstance", singular="pdinstance", namespaced=True, subresources={"status"}, shortnames={"pdi"}),
}
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
PODS, SERVICES, SECRETS = kmock.resource("", "v1", "pods"), kmock.resource("", "v1", "services"), \
    kmock.resource("", "v1", "secrets")
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES = kmock.resource("", "v1", "namespaces")
PROPAGATION_FINALIZERS = {"Foreground": "foregroundDeletion", "Orphan": "orphan"}


_kmock_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    """kmock reads ``/api/v1/namespaces/NAME`` as a namespace prefix; it is the Namespace
    object (with its ``status`` and ``finalize`` subresources) unless a plural follows."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (len(parts) <= 4 or (
            len(parts) == 5 and parts[4] in ("status", "finalize"))):
        name, sub = (parts[3:] + [None, None])[:2]
        return parsing.ParsedPath("", "v1", "namespaces", None, name, sub)
    return _kmock_parse_path(path)


parsing.parse_path = _parse_path  # read by kmock's request parser at every request


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


def matches_fields(obj: dict, selector: str | None) -> bool:
    """Field selectors (``metadata.name=x,spec.nodeName!=``) on any dotted path."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        is_negated = "!=" in term
        path, value = term.split("!=", 1) if is_negated else term.replace("==", "=").split("=", 1)
        actual: object = obj
        for part in path.strip().split("."):
            actual = actual.get(part) if isinstance(actual, dict) else None
        if (("" if actual is None else str(actual)) == value.strip()) == is_negated:
            return False
    return True


def apply_structural_schema(value: object, schema: dict | None) -> object:
    """Prune fields a structural schema does not declare and fill its defaults, in place
    (what the apiserver does to a custom object on every write)."""
    if not isinstance(schema, dict):
        return value
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_structural_schema(item, schema["items"])
    if not isinstance(value, dict):
        return value
    props, extra = schema.get("properties"), schema.get("additionalProperties")
    if props is not None:
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            for key in [k for k in value if k not in props]:
                del value[key]
        for key, sub in props.items():
            if key in value:
                apply_structural_schema(value[key], sub)
    elif isinstance(extra, dict):
        for item in value.values():
            apply_structural_schema(item, extra)
    elif schema.get("type") == "object" and not extra and not schema.get("x-kubernetes-preserve-unknown-fields"):
        value.clear()
    return value


DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
PORT_NAME = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")
LABEL_NAMED = (SERVICES, NAMESPACES)


def _check_name(field: str, value: object, pattern: re.Pattern, max_len: int) -> str | None:
    text = str(value)
    if len(text) > max_len:
        return f"{field}: Invalid value: {text!r}: must be no more than {max_len} characters"
    if not pattern.fullmatch(text):
        return f"{field}: Invalid value: {text!r}: must match the regex {pattern.pattern}"
    return None


def validation_errors(resource, body: dict) -> list[str]:
    """The apiserver's name, label and Pod-field validation of ``body`` (a subset)."""
    meta = body.get("metadata") or {}
    errors = [_check_name("metadata.name", meta.get("name"), DNS_1035_LABEL if resource == SERVICES else
                          DNS_LABEL if resource == NAMESPACES else DNS_SUBDOMAIN,
                          63 if resource in LABEL_NAMED else 253)]
    for key, value in (meta.get("labels") or {}).items():
        prefix, _, name = key.rpartition("/")
        errors.append(_check_name(f"metadata.labels[{key}]", name, LABEL_NAME, 63))
        if prefix:
            errors.append(_check_name(f"metadata.labels[{key}]", prefix, DNS_SUBDOMAIN, 253))
        if value:
            errors.append(_check_name(f"metadata.labels[{key}]", value, LABEL_NAME, 63))
    if resource == PODS:
        spec = body.get("spec") or {}
        for field in ("hostname", "subdomain"):
            if spec.get(field):
                errors.append(_check_name(f"spec.{field}", spec[field], DNS_LABEL, 63))
        for i, c in enumerate([*(spec.get("initContainers") or []), *(spec.get("containers") or [])]):
            errors.append(_check_name(f"spec.containers[{i}].name", c.get("name"), DNS_LABEL, 63))
            for port in c.get("ports") or []:
                if port.get("name"):
                    errors.append(_check_name(f"spec.containers[{i}].ports.name", port["name"], PORT_NAME, 15))
    return [e for e in errors if e]


POD_MUTABLE = ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds")


def _pod_spec_fixed(spec: dict | None) -> dict:
    """A Pod spec without what an update may change (images, deadlines, tolerations)."""
    fixed = {k: v for k, v in (spec or {}).items() if k not in POD_MUTABLE}
    for key in ("containers", "initContainers"):
        if key in fixed:
            fixed[key] = [{k: v for k, v in c.items() if k != "image"} for c in fixed[key]]
    return fixed


def immutability_errors(resource, new: dict, old: dict) -> list[str]:
    """Fields the apiserver refuses to change on an update (a subset)."""
    spec, old_spec = new.get("spec") or {}, old.get("spec") or {}
    if resource == PODS and _pod_spec_fixed(spec) != _pod_spec_fixed(old_spec):
        return ["spec: Forbidden: pod updates may not change fields other than `spec.containers[*].image`, "
                "`spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, `spec.tolerations` (only "
                "additions to existing tolerations), `spec.terminationGracePeriodSeconds`"]
    if resource == DEPLOYMENTS and spec.get("selector") != old_spec.get("selector"):
        return ["spec.selector: Invalid value: field is immutable"]
    if resource == SERVICES and spec.get("clusterIP") != old_spec.get("clusterIP"):
        return ["spec.clusterIP: Invalid value: field is immutable"]
    return []


def _now(after_s: float = 0) -> str:
    moment = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=after_s)
    return moment.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _status(code: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=code, reason=reason, message=message, details={})


def _default_service_ips() -> Iterator[str]:
    return (f"10.96.{i // 256}.{i % 256}" for i in itertools.count(1))


def _is_gone(meta: dict) -> bool:
    """Marked for deletion, no finalizer left, and no grace period still running."""
    return bool(meta.get("deletionTimestamp")) and not meta.get("finalizers") \
        and not meta.get("deletionGracePeriodSeconds")


@attrs.define(kw_only=True)
class StrictEmulator(kmock.KubernetesEmulator):
    with_pdserve_crds: bool = True
    """Serve PDCluster and PDInstance without their CRDs (the operator tests)."""
    service_ips: Iterator[str] = attrs.field(factory=_default_service_ips)
    """ClusterIPs handed to Services, in order (the stand-in passes loopback ones)."""
    pod_logs: Callable[[str, str, dict], str] | None = None
    """``(namespace, pod, query) -> text`` for ``GET pods/NAME/log`` (a kubelet's)."""
    _versions: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)
    _schemas: dict = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, info in {**RESOURCES, **(PDSERVE_RESOURCES if self.with_pdserve_crds else {})}.items():
            info.verbs = set(VERBS)
            self.resources[key] = info

    def live_objects(self) -> Iterator[tuple[kmock.resource, dict]]:
        """Every stored object (not a copy: read only). Called on the server's loop by
        the stand-in's controllers, which stand for an informer cache."""
        for (resource, _, _), obj in list(self.objects.items()):
            if not obj.deleted:
                yield resource, obj.raw

    async def _serve_version(self, request):
        result = await super()._serve_version(request)
        result["groupVersion"] = result["groupVersion"].lstrip("/")  # the core group's is "v1"
        for entry in result["resources"]:
            if "/" in entry["name"]:  # subresources have no short names of their own
                entry["shortNames"], entry["categories"] = [], []
        return result

    def _has_status(self, resource) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _bump(self, body: dict) -> None:
        body.setdefault("metadata", {})["resourceVersion"] = str(next(self._versions))

    async def _handle(self, request):
        action, method = request.action, request.method
        if getattr(request.resource, "plural", None) is None:  # discovery
            return await super(kmock.KubernetesEmulator, self)._handle(request)
        if request.resource not in self.resources:
            raise _status(404, "NotFound", f"the server could not find the requested resource "
                                           f"{request.resource}")
        if action == enums.action.WATCH:
            return await self._stream(request)
        if action == enums.action.LIST:
            return aiohttp.web.json_response(await self._serve_list(request))
        if action == enums.action.FETCH and request.subresource == "log" and request.resource == PODS:
            return await self._serve_log(request)
        if action == enums.action.FETCH:
            return aiohttp.web.json_response(await self._serve_fetch(request))
        async with self._lock:
            if action == enums.action.CREATE:
                body = await self._create(request)
            elif action == enums.action.UPDATE:
                body = await self._update(request, self._patched)
            elif method == enums.method.PUT and request.name:
                body = await self._update(request, self._replaced)
            elif method == enums.method.POST and request.subresource == "binding" and request.resource == PODS:
                body = await self._bind(request)
            elif action == enums.action.DELETE:
                body = await self._delete(request)
            else:
                raise _status(405, "MethodNotAllowed", f"{method} {request.url.path}")
        return aiohttp.web.json_response(body, status=201 if action == enums.action.CREATE else 200)

    async def _stream(self, request) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        timeout_s = request.params.get("timeoutSeconds")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(float(timeout_s) if timeout_s else None), \
                    contextlib.aclosing(self._serve_watch(request)) as events:
                async for event in events:
                    if event != b"":
                        await response.write(json.dumps(event).encode() + b"\n")
        return response

    async def _serve_log(self, request) -> aiohttp.web.Response:
        await self._serve_fetch(request)  # 404 for an unknown Pod
        if self.pod_logs is None:
            raise _status(404, "NotFound", "no kubelet serves logs")
        text = self.pod_logs(request.namespace, request.name, dict(request.params))
        return aiohttp.web.Response(text=text, content_type="text/plain")

    def _admit(self, resource, body: dict, old: dict | None) -> None:
        """Defaulting, then validation, on every write (as mutating, then validating,
        admission). Raises 422 with every problem found."""
        if resource == SERVICES:
            spec = body.setdefault("spec", {})
            spec.setdefault("type", "ClusterIP")
            if not spec.get("clusterIP") and spec["type"] != "ExternalName":
                spec["clusterIP"] = ((old or {}).get("spec") or {}).get("clusterIP") or next(self.service_ips)
            if spec.get("clusterIP"):
                spec.setdefault("clusterIPs", [spec["clusterIP"]])
            for port in spec.get("ports") or []:
                port.setdefault("protocol", "TCP")
                port.setdefault("targetPort", port.get("port"))
        elif resource == SECRETS and body.get("stringData"):
            data = body.setdefault("data", {})
            for key, text in body.pop("stringData").items():
                data[key] = base64.b64encode(str(text).encode()).decode()
        elif resource in self._schemas:
            kept = {k: body.pop(k) for k in ("apiVersion", "kind", "metadata") if k in body}
            apply_structural_schema(body, self._schemas[resource])
            body.update(kept)
        errors = [f"metadata.ownerReferences.uid: Invalid value: \"\": owner {ref.get('name')} has no uid"
                  for ref in body.get("metadata", {}).get("ownerReferences") or [] if not ref.get("uid")]
        errors += validation_errors(resource, body)
        if old is not None:
            errors += immutability_errors(resource, body, old)
        if errors:
            kind = self.resources[resource].kind if resource in self.resources else resource.plural
            raise _status(422, "Invalid", f"{kind} {body.get('metadata', {}).get('name')!r} is invalid: "
                                          + "; ".join(errors))

    async def _create(self, request) -> dict:
        body = request.data
        if not isinstance(body, dict):
            raise _status(400, "BadRequest", "the body is not a JSON object")
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace:
            meta["namespace"] = request.namespace
        key = (request.resource, meta.get("namespace"), meta.get("name"))
        if key in self.objects and not self.objects[key].deleted:
            raise _status(409, "AlreadyExists", f"{meta.get('name')} already exists")
        self._admit(request.resource, body, None)
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now())
        if request.resource == CRDS:
            self._serve_crd(body)
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

    @staticmethod
    def _patched(old: dict, request) -> dict:
        if isinstance(request.data, list):  # application/json-patch+json
            try:
                return jsonpatch.apply_patch(old, request.data)
            except (jsonpatch.JsonPatchConflict, jsonpatch.JsonPatchTestFailed) as exc:
                raise _status(422, "Invalid", f"the JSON patch does not apply: {exc}") from None
        StrictEmulator._check_version(old, request.data)
        return merge_patch(old, request.data)

    @staticmethod
    def _replaced(old: dict, request) -> dict:
        StrictEmulator._check_version(old, request.data)
        new = copy.deepcopy(request.data)
        meta = new.setdefault("metadata", {})
        for field in ("creationTimestamp", "generation", "deletionTimestamp", "deletionGracePeriodSeconds",
                      "namespace", "name"):
            if field in old["metadata"]:
                meta[field] = old["metadata"][field]
        return new

    @staticmethod
    def _check_version(old: dict, data: object) -> None:
        if not isinstance(data, dict):
            raise _status(400, "BadRequest", "the body is not a JSON object")
        wanted_rv = (data.get("metadata") or {}).get("resourceVersion")
        if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
            raise _status(409, "Conflict", "the object has been modified")

    async def _update(self, request, change) -> dict:
        key, old = self._existing(request)
        new = change(old, request)
        if self._has_status(request.resource):
            if request.subresource == "status":
                new = {**old, "status": new.get("status")}
            elif "status" in old:
                new["status"] = old["status"]
            else:
                new.pop("status", None)
        new["metadata"] = {**new["metadata"], "resourceVersion": old["metadata"]["resourceVersion"],
                           "uid": old["metadata"]["uid"]}
        self._admit(request.resource, new, old)
        if new == old:
            return old
        if new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        if request.resource == CRDS:
            self._serve_crd(new)
        self._bump(new)
        await self._store(key, request.resource, new)
        return new

    async def _bind(self, request) -> dict:
        key, old = self._existing(request)
        if (old.get("spec") or {}).get("nodeName"):
            raise _status(409, "Conflict", f"pod {request.name} is already assigned to a node")
        old.setdefault("spec", {})["nodeName"] = ((request.data or {}).get("target") or {}).get("name")
        self._bump(old)
        await self._store(key, request.resource, old)
        return {"apiVersion": "v1", "kind": "Status", "status": "Success", "code": 201}

    @staticmethod
    def _delete_options(request) -> tuple[str, int | None]:
        body = request.data if isinstance(request.data, dict) else {}
        policy = request.params.get("propagationPolicy") or body.get("propagationPolicy") or "Background"
        grace = request.params.get("gracePeriodSeconds", body.get("gracePeriodSeconds"))
        return policy, None if grace is None else int(grace)

    async def _delete(self, request) -> dict:
        key, old = self._existing(request)
        meta = old["metadata"]
        policy, grace_s = self._delete_options(request)
        spec = old.get("spec") or {}
        if request.resource != PODS or not spec.get("nodeName"):
            grace_s = 0
        elif grace_s is None:
            grace_s = spec.get("terminationGracePeriodSeconds", 30)
        finalizers = list(meta.get("finalizers") or [])
        if not meta.get("deletionTimestamp") and PROPAGATION_FINALIZERS.get(policy) not in (None, *finalizers):
            finalizers.append(PROPAGATION_FINALIZERS[policy])
        if grace_s == 0 and not finalizers:
            self._bump(old)
            self.objects[key].create(old)
            self.objects[key].delete()
            await self._buses[request.resource].put({"type": "DELETED", "object": old})
            if request.resource == CRDS:
                await self._unserve_crd(old)
            return old
        new = copy.deepcopy(old)
        new["metadata"]["finalizers"] = finalizers
        new["metadata"].setdefault("deletionTimestamp", _now(grace_s))
        if grace_s < new["metadata"].get("deletionGracePeriodSeconds", grace_s + 1):
            new["metadata"]["deletionGracePeriodSeconds"] = grace_s
        if new != old:
            self._bump(new)
            await self._store(key, request.resource, new)
        return new

    async def _store(self, key, resource, new: dict) -> None:
        self.objects[key].create(new)
        if _is_gone(new["metadata"]):
            self.objects[key].delete()
            await self._buses[resource].put({"type": "DELETED", "object": copy.deepcopy(new)})
            if resource == CRDS:
                await self._unserve_crd(new)
        else:
            await self._buses[resource].put({"type": "MODIFIED", "object": copy.deepcopy(new)})

    def _serve_crd(self, crd: dict) -> None:
        """Serve (or re-serve) the resources of a CRD; mark it Established."""
        spec, names = crd["spec"], crd["spec"]["names"]
        for version in spec.get("versions") or []:
            if not version.get("served", True):
                continue
            resource = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[resource] = kmock.ResourceInfo(
                kind=names["kind"], namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                singular=names.get("singular"), verbs=set(VERBS), shortnames=set(names.get("shortNames") or ()),
                categories=set(names.get("categories") or ()),
                subresources={"status"} if "status" in (version.get("subresources") or {}) else set())
            self._schemas[resource] = (version.get("schema") or {}).get("openAPIV3Schema")
        crd["status"] = {"acceptedNames": names, "storedVersions": [
            v["name"] for v in spec.get("versions") or [] if v.get("storage")], "conditions": [
            {"type": t, "status": "True", "reason": r, "lastTransitionTime": _now()}
            for t, r in (("NamesAccepted", "NoConflicts"), ("Established", "InitialNamesAccepted"))]}

    async def _unserve_crd(self, crd: dict) -> None:
        spec = crd["spec"]
        for version in spec.get("versions") or []:
            resource = kmock.resource(spec["group"], version["name"], spec["names"]["plural"])
            self._schemas.pop(resource, None)
            if resource in self.resources:
                del self.resources[resource]
            for key, obj in list(self.objects.items()):
                if key[0] == resource and not obj.deleted:
                    raw = copy.deepcopy(obj.raw)
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})

    async def _serve_list(self, request):
        result = await super()._serve_list(request)
        labels, fields = request.params.get("labelSelector"), request.params.get("fieldSelector")
        result["items"] = [i for i in result["items"]
                           if matches_selector((i.get("metadata") or {}).get("labels") or {}, labels)
                           and matches_fields(i, fields)]
        result["metadata"] = {"resourceVersion": str(next(self._versions))}
        info = self.resources[request.resource]
        result["kind"] = f"{info.kind}List"
        result["apiVersion"] = "/".join(p for p in (request.resource.group, request.resource.version) if p)
        return result

    async def _serve_watch(self, request):
        yield b""
        labels, fields = request.params.get("labelSelector"), request.params.get("fieldSelector")
        bus = self._buses[request.resource]
        async with self._lock:  # writes hold this lock too: nothing slips in between
            mark = await bus.mark()
            objs = [o.raw for o in self._KubernetesEmulator__get_objs(request, strict=False)
                    if not o.deleted]
        try:
            for obj in objs:
                if matches_selector(obj["metadata"].get("labels") or {}, labels) and matches_fields(obj, fields):
                    yield {"type": "ADDED", "object": obj}
            async for event in mark:
                obj = event.get("object", {})
                meta = obj.get("metadata", {})
                if (self._KubernetesEmulator__check(request, request.resource, meta.get("namespace"),
                                                    meta.get("name"), strict=False)
                        and matches_selector(meta.get("labels") or {}, labels) and matches_fields(obj, fields)):
                    yield event
        finally:
            await bus.unmark(mark)
