"""The ``scale`` subresource of custom resources, which the emulator does not serve.

A CRD version with ``subresources.scale`` gets what an apiserver gives it:
``GET .../NAME/scale`` answers an ``autoscaling/v1`` ``Scale`` read from the object
at the CRD's ``specReplicasPath``, ``statusReplicasPath`` and ``labelSelectorPath``;
``PATCH`` (merge patch) and ``PUT`` of a Scale write its ``spec.replicas`` at
``specReplicasPath`` through the emulator's own update (versioning, a
``resourceVersion`` precondition, admission, watch events; the status is kept); and
discovery lists ``<plural>/scale`` as ``autoscaling/v1`` ``Scale``, which is how
``kubectl scale`` and the autoscalers' scale clients find and decode it.

Not emulated: JSON patches of a Scale, the built-in kinds' scale (Deployments are
scaled through their spec here), validation of the replicas against the schema.
"""

from __future__ import annotations

import copy

import aiohttp.web
import attrs
import kmock
from kmock._internal import enums

from tests.kmock_emulator import StrictEmulator


def _error(code: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=code, reason=reason, message=message, details={})


def read_path(obj: dict, where: str) -> object:
    """The value at a CRD's JSON path such as ``.spec.replicas``; None when absent."""
    node: object = obj
    for part in where.lstrip(".").split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def with_path(obj: dict, where: str, value: object) -> dict:
    """A copy of ``obj`` with ``value`` at ``where`` (the objects on the way made)."""
    out = copy.deepcopy(obj)
    *parents, last = where.lstrip(".").split(".")
    node = out
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return out


def to_scale(obj: dict, paths: dict) -> dict:
    """The ``autoscaling/v1`` Scale of ``obj`` under a CRD's ``subresources.scale``."""
    meta = obj["metadata"]
    status = {"replicas": read_path(obj, paths["statusReplicasPath"]) or 0}
    selector = read_path(obj, paths["labelSelectorPath"]) if "labelSelectorPath" in paths else None
    if selector:
        status["selector"] = selector
    return {"apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                         if k in meta},
            "spec": {"replicas": read_path(obj, paths["specReplicasPath"]) or 0},
            "status": status}


@attrs.define(kw_only=True)
class ScalingEmulator(StrictEmulator):
    """The strict emulator plus the scale subresource of CRDs that declare one."""

    _scales: dict = attrs.field(factory=dict, init=False)  # resource -> subresources.scale

    def _serve_crd(self, crd: dict) -> None:
        super()._serve_crd(crd)
        spec = crd["spec"]
        for version in spec.get("versions") or []:
            resource = kmock.resource(spec["group"], version["name"], spec["names"]["plural"])
            scale = (version.get("subresources") or {}).get("scale")
            if scale is not None and resource in self.resources:
                self._scales[resource] = scale
                self.resources[resource].subresources.add("scale")
            else:
                self._scales.pop(resource, None)

    async def _unserve_crd(self, crd: dict) -> None:
        await super()._unserve_crd(crd)
        spec = crd["spec"]
        for version in spec.get("versions") or []:
            self._scales.pop(kmock.resource(spec["group"], version["name"], spec["names"]["plural"]), None)

    async def _serve_version(self, request):
        result = await super()._serve_version(request)
        for entry in result["resources"]:
            if entry["name"].endswith("/scale"):
                entry.update(group="autoscaling", version="v1", kind="Scale", verbs=["get", "patch", "update"])
        return result

    async def _handle(self, request):
        if request.subresource == "scale" and getattr(request.resource, "plural", None) is not None \
                and request.resource in self._scales:
            return aiohttp.web.json_response(await self._serve_scale(request))
        return await super()._handle(request)

    async def _serve_scale(self, request) -> dict:
        paths = self._scales[request.resource]
        if request.action == enums.action.FETCH:
            return to_scale(await self._serve_fetch(request), paths)
        if request.method not in (enums.method.PATCH, enums.method.PUT):
            raise _error(405, "MethodNotAllowed", f"{request.method} of a scale subresource")
        data = request.data
        if not isinstance(data, dict):
            raise _error(415, "UnsupportedMediaType", "a Scale is changed by a merge patch or a PUT")
        replicas = (data.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise _error(422, "Invalid", f"spec.replicas: Invalid value: {replicas!r}: must be a "
                                         "non-negative integer")

        def scaled(old: dict, _request) -> dict:
            self._check_version(old, data)  # a Scale's resourceVersion is its object's
            return with_path(old, paths["specReplicasPath"], replicas)

        async with self._lock:
            return to_scale(await self._update(request, scaled), paths)
