"""The one module that calls the Kubernetes API: typed paths, CRUD, merge patches.

Owns ``KubeClient`` (an ``httpx.AsyncClient`` on an injectable base URL: in-cluster
service-account credentials, a kubeconfig, or a test's emulator) and the error
types reconcile reacts to. Everything else in the operator works on plain dicts.

Invariants: writes are JSON merge patches (never PUT), so fields other writers own
(the apiserver's defaults, kopf's annotations) are kept; a 404 on
read or delete is an answer (``None`` / ``False``), not an error; every other
failure raises ``KubeError`` with ``is_transient`` telling retry from give-up.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from pdserve.api.common import API_VERSION

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

# kind -> (API prefix, plural)
KINDS: dict[str, tuple[str, str]] = {
    "Pod": ("api/v1", "pods"),
    "Service": ("api/v1", "services"),
    "EndpointSlice": ("apis/discovery.k8s.io/v1", "endpointslices"),
    "ConfigMap": ("api/v1", "configmaps"),
    "Secret": ("api/v1", "secrets"),
    "Deployment": ("apis/apps/v1", "deployments"),
    "PodDisruptionBudget": ("apis/policy/v1", "poddisruptionbudgets"),
    "PDCluster": (f"apis/{API_VERSION}", "pdclusters"),
    "PDInstance": (f"apis/{API_VERSION}", "pdinstances"),
    "PDPool": (f"apis/{API_VERSION}", "pdpools"),
}


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status

    @property
    def is_transient(self) -> bool:
        """Worth retrying: conflicts, throttling, server errors, no connection (0)."""
        return self.status in (0, 409, 429) or self.status >= 500


def path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    prefix, plural = KINDS[kind]
    parts = [prefix, "namespaces", namespace, plural, name, subresource]
    return "/" + "/".join(p for p in parts if p)


def is_subset(desired: object, observed: object) -> bool:
    """True when every field of ``desired`` has the same value in ``observed``; list
    items are compared pairwise, so fields the apiserver defaults inside them (a
    container's ``terminationMessagePath``, a port's ``protocol``) do not count."""
    if isinstance(desired, dict):
        return isinstance(observed, dict) and all(
            is_subset(v, observed.get(k)) for k, v in desired.items())
    if isinstance(desired, list):
        return (isinstance(observed, list) and len(desired) == len(observed)
                and all(is_subset(d, o) for d, o in zip(desired, observed, strict=True)))
    return desired == observed


class KubeClient:
    """Async Kubernetes API client. Called by reconcile only; one per operator."""

    def __init__(self, base_url: str, token: str | None = None, verify: bool | str = True,
                 cert: tuple[str, str] | None = None, timeout_s: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=base_url, headers=headers, verify=verify,
                                       cert=cert, timeout=timeout_s)

    @classmethod
    def from_environment(cls) -> KubeClient:
        """In a Pod: the service account; elsewhere: the current kubeconfig context."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if host and (SERVICE_ACCOUNT_DIR / "token").exists():
            token = (SERVICE_ACCOUNT_DIR / "token").read_text().strip()
            return cls(f"https://{host}:{port or 443}", token, str(SERVICE_ACCOUNT_DIR / "ca.crt"))
        from kubernetes import client, config

        cfg = client.Configuration()
        config.load_kube_config(client_configuration=cfg)
        token = (cfg.api_key or {}).get("authorization", "").removeprefix("Bearer ") or None
        cert = (cfg.cert_file, cfg.key_file) if cfg.cert_file else None
        verify = cfg.ssl_ca_cert or cfg.verify_ssl
        return cls(cfg.host, token, verify, cert)

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, url: str, **kwargs) -> httpx.Response:
        try:
            response = await self._http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise KubeError(0, f"{method} {url}: {exc!r}") from exc
        if response.status_code >= 400 and response.status_code != 404:
            try:
                message = response.json().get("message", response.text)
            except ValueError:
                message = response.text
            raise KubeError(response.status_code, f"{method} {url}: {message}")
        return response

    async def get(self, kind: str, namespace: str, name: str) -> dict | None:
        response = await self._request("GET", path(kind, namespace, name))
        return None if response.status_code == 404 else response.json()

    async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        response = await self._request("GET", path(kind, namespace),
                                       params={"labelSelector": selector})
        if response.status_code == 404:
            raise KubeError(404, f"cannot list {kind}: is its CRD installed?")
        return [i for i in response.json().get("items", []) if is_subset(labels, _labels(i))]

    async def create(self, body: dict) -> dict:
        meta = body["metadata"]
        response = await self._request("POST", path(body["kind"], meta["namespace"]), json=body)
        if response.status_code == 404:
            raise KubeError(404, f"cannot create {body['kind']} {meta['name']}")
        return response.json()

    async def patch(self, kind: str, namespace: str, name: str, patch: dict,
                    subresource: str | None = None) -> dict | None:
        response = await self._request(
            "PATCH", path(kind, namespace, name, subresource), json=patch,
            headers={"Content-Type": "application/merge-patch+json"})
        return None if response.status_code == 404 else response.json()

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete (background propagation: owned objects go through the GC). False if absent."""
        response = await self._request("DELETE", path(kind, namespace, name),
                                       params={"propagationPolicy": "Background"})
        return response.status_code != 404

    async def apply(self, body: dict) -> tuple[str, dict]:
        """Create ``body``, or merge-patch it where what we own differs. Returns
        (``created`` | ``updated`` | ``unchanged``, the object)."""
        meta = body["metadata"]
        observed = await self.get(body["kind"], meta["namespace"], meta["name"])
        if observed is None:
            return "created", await self.create(body)
        if is_subset(body, observed):
            return "unchanged", observed
        patched = await self.patch(body["kind"], meta["namespace"], meta["name"], body)
        return "updated", patched or observed


def _labels(obj: dict) -> dict:
    return obj.get("metadata", {}).get("labels") or {}
