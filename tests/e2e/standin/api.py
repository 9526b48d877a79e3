"""How the stand-in's kubelet and controllers talk to the API emulator.

``Api`` reads from the emulator's store directly (the role of an informer cache:
cheap, consistent within one loop iteration, read only) and writes over HTTP, so
every write goes through the same admission, versioning and watch events as the
operator's and kopf's writes. It runs on the cluster's event loop only.
"""

from __future__ import annotations

import aiohttp
import kmock

from tests.kmock_emulator import StrictEmulator

PODS = kmock.resource("", "v1", "pods")
SERVICES = kmock.resource("", "v1", "services")
ENDPOINTS = kmock.resource("", "v1", "endpoints")
ENDPOINTSLICES = kmock.resource("discovery.k8s.io", "v1", "endpointslices")
CONFIGMAPS = kmock.resource("", "v1", "configmaps")
SECRETS = kmock.resource("", "v1", "secrets")
PVCS = kmock.resource("", "v1", "persistentvolumeclaims")
NODES = kmock.resource("", "v1", "nodes")
NAMESPACES = kmock.resource("", "v1", "namespaces")
SERVICEACCOUNTS = kmock.resource("", "v1", "serviceaccounts")
EVENTS = kmock.resource("", "v1", "events")
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def url_path(resource: kmock.resource, namespace: str | None, name: str | None = None,
             subresource: str | None = None) -> str:
    prefix = f"/api/{resource.version}" if not resource.group else f"/apis/{resource.group}/{resource.version}"
    parts = [prefix, f"namespaces/{namespace}" if namespace else None, resource.plural, name, subresource]
    return "/".join(p for p in parts if p)


def meta(obj: dict) -> dict:
    return obj.get("metadata") or {}


def is_deleting(obj: dict | None) -> bool:
    return bool(obj and meta(obj).get("deletionTimestamp"))


class Api:
    def __init__(self, emulator: StrictEmulator, base_url: str) -> None:
        self.emulator, self.base_url = emulator, base_url.rstrip("/")
        self._http: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    # reads: the store itself (never mutate what these return)

    def list(self, resource: kmock.resource, namespace: str | None = None) -> list[dict]:
        return [obj for res, obj in self.emulator.live_objects()
                if res == resource and (namespace is None or meta(obj).get("namespace") == namespace)]

    def get(self, resource: kmock.resource, namespace: str | None, name: str) -> dict | None:
        return next((o for o in self.list(resource, namespace) if meta(o).get("name") == name), None)

    def uids(self) -> dict[str, tuple[kmock.resource, dict]]:
        return {meta(obj).get("uid"): (res, obj) for res, obj in self.emulator.live_objects()}

    # writes: over HTTP

    async def _request(self, method: str, path: str, **kwargs) -> dict | None:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        async with self._http.request(method, self.base_url + path, **kwargs) as response:
            if response.status == 404:
                return None
            body = await response.json(content_type=None)
            if response.status >= 400:
                raise ApiError(response.status, (body or {}).get("message", ""))
            return body

    async def create(self, resource: kmock.resource, body: dict) -> dict:
        return await self._request("POST", url_path(resource, meta(body).get("namespace")), json=body)

    async def patch(self, resource: kmock.resource, namespace: str | None, name: str, patch: dict,
                    subresource: str | None = None) -> dict | None:
        return await self._request("PATCH", url_path(resource, namespace, name, subresource), json=patch,
                                   headers={"Content-Type": "application/merge-patch+json"})

    async def delete(self, resource: kmock.resource, namespace: str | None, name: str, *,
                     grace_s: int | None = None, propagation: str | None = None) -> bool:
        params = {k: str(v) for k, v in (("gracePeriodSeconds", grace_s), ("propagationPolicy", propagation))
                  if v is not None}
        return await self._request("DELETE", url_path(resource, namespace, name), params=params) is not None

    async def bind(self, pod: dict, node: str) -> None:
        m = meta(pod)
        await self._request("POST", url_path(PODS, m["namespace"], m["name"], "binding"), json={
            "apiVersion": "v1", "kind": "Binding", "metadata": {"name": m["name"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}})
