"""``Kubectl``: what a test does with ``kubectl``, against the stand-in, from the test's thread.

apply (a YAML file, YAML text, a dict or a list: create, else merge-patch what the
document sets, as a client-side apply of owned fields), create, get, list (label
and field selectors), patch, delete (propagation, grace; optionally waiting until
the object is gone), wait (a predicate or a condition, with a deadline), logs
(``pods/NAME/log``) and exec (inside a running container). Kinds are resolved by API
discovery and looked up again when a kind is unknown (a CRD applied meanwhile).
Plain HTTP to the emulator; the real clients (kopf, the operator, kubectl) use the
kubeconfig's TLS endpoint instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import httpx
import yaml

if TYPE_CHECKING:
    from tests.e2e.standin.cluster import Cluster

T = TypeVar("T")


class KubectlError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def condition_status(obj: dict | None, type_: str) -> str | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c.get("status")
    return None


def wait_for(check: Callable[[], T], timeout_s: float = 60.0, what: str = "condition",
             interval_s: float = 0.2) -> T:
    """Call ``check`` until it returns something truthy; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: T = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}; last: {last!r}")


def load_documents(source: Path | str | dict | list) -> list[dict]:
    if isinstance(source, dict):
        return [source]
    if isinstance(source, list):
        return [d for item in source for d in load_documents(item)]
    text = source.read_text() if isinstance(source, Path) else source
    return [d for d in yaml.safe_load_all(text) if d]


class Kubectl:
    def __init__(self, cluster: Cluster, namespace: str = "default") -> None:
        self.cluster, self.namespace = cluster, namespace
        self._http = httpx.Client(base_url=cluster.api_url, timeout=30)
        self._kinds: dict[str, tuple[str, str, bool]] = {}

    def _discover(self) -> None:
        kinds = {}
        groups = [("/api/v1", "v1")] + [
            (f"/apis/{v['groupVersion']}", v["groupVersion"])
            for g in self._http.get("/apis").json().get("groups") or [] for v in g.get("versions") or []]
        for url, group_version in groups:
            for r in self._http.get(url).json().get("resources") or []:
                if "/" not in r["name"]:
                    for key in {r["kind"], r["kind"].lower(), r["name"], *(r.get("shortNames") or [])}:
                        kinds[key] = (url, r["name"], r.get("namespaced", True))
                    kinds[f"{group_version}/{r['kind']}"] = (url, r["name"], r.get("namespaced", True))
        self._kinds = kinds

    def _path(self, kind: str, namespace: str | None, name: str | None = None, sub: str | None = None,
              api_version: str | None = None, all_namespaces: bool = False) -> str:
        key = f"{api_version}/{kind}" if api_version else kind
        if key not in self._kinds:
            self._discover()
        if key not in self._kinds:
            raise KubectlError(404, f"the server doesn't have a resource type {key!r}")
        url, plural, is_namespaced = self._kinds[key]
        ns = f"namespaces/{namespace or self.namespace}" if is_namespaced and not all_namespaces else None
        return "/".join(p for p in (url, ns, plural, name, sub) if p)

    def _call(self, method: str, path: str, **kwargs) -> dict | None:
        response = self._http.request(method, path, **kwargs)
        if response.status_code == 404:
            return None
        if response.status_code >= 400:
            raise KubectlError(response.status_code, response.json().get("message", response.text))
        return response.json()

    def apply(self, source: Path | str | dict | list, namespace: str | None = None) -> list[dict]:
        applied = []
        for doc in load_documents(source):
            m = doc.get("metadata") or {}
            ns = m.get("namespace") or namespace
            kind, version = doc["kind"], doc.get("apiVersion")
            existing = self._call("GET", self._path(kind, ns, m["name"], api_version=version))
            if existing is None:
                applied.append(self._call("POST", self._path(kind, ns, api_version=version), json=doc))
            else:
                body = {k: v for k, v in doc.items() if k != "status"}
                applied.append(self._call("PATCH", self._path(kind, ns, m["name"], api_version=version),
                                          json=body, headers={"Content-Type": "application/merge-patch+json"}))
        return applied

    def create(self, doc: dict, namespace: str | None = None) -> dict:
        m = doc.get("metadata") or {}
        return self._call("POST", self._path(doc["kind"], m.get("namespace") or namespace,
                                             api_version=doc.get("apiVersion")), json=doc)

    def get(self, kind: str, name: str, namespace: str | None = None,
            subresource: str | None = None) -> dict | None:
        return self._call("GET", self._path(kind, namespace, name, subresource))

    def list(self, kind: str, namespace: str | None = None, labels: dict | str | None = None,
             fields: str | None = None, all_namespaces: bool = False) -> list[dict]:
        selector = ",".join(f"{k}={v}" for k, v in labels.items()) if isinstance(labels, dict) else labels
        params = {k: v for k, v in (("labelSelector", selector), ("fieldSelector", fields)) if v}
        path = self._path(kind, namespace, all_namespaces=all_namespaces)
        return (self._call("GET", path, params=params) or {}).get("items") or []

    def patch(self, kind: str, name: str, patch: dict, namespace: str | None = None,
              subresource: str | None = None) -> dict | None:
        return self._call("PATCH", self._path(kind, namespace, name, subresource), json=patch,
                          headers={"Content-Type": "application/merge-patch+json"})

    def delete(self, kind: str, name: str, namespace: str | None = None, *, propagation: str | None = None,
               grace_s: int | None = None, wait_s: float | None = None) -> bool:
        params = {k: str(v) for k, v in (("propagationPolicy", propagation), ("gracePeriodSeconds", grace_s))
                  if v is not None}
        found = self._call("DELETE", self._path(kind, namespace, name), params=params) is not None
        if found and wait_s:
            wait_for(lambda: self.get(kind, name, namespace) is None, wait_s, f"{kind} {name} to be gone")
        return found

    def wait(self, kind: str, name: str, predicate: Callable[[dict], bool] | None = None, *,
             condition: str | None = None, namespace: str | None = None, timeout_s: float = 60.0) -> dict:
        """The object once ``predicate(obj)`` holds (or its ``condition`` is True)."""
        def check():
            obj = self.get(kind, name, namespace)
            if obj is None:
                return None
            ok = predicate(obj) if predicate else condition_status(obj, condition) == "True"
            return obj if ok else None
        return wait_for(check, timeout_s, f"{kind} {name} " + (f"condition {condition}" if condition else "to match"))

    def logs(self, pod: str, namespace: str | None = None, container: str | None = None,
             previous: bool = False) -> str:
        params = {k: v for k, v in (("container", container), ("previous", "true" if previous else None)) if v}
        response = self._http.get(self._path("Pod", namespace, pod, "log"), params=params)
        return response.text if response.status_code == 200 else ""

    def exec(self, pod: str, argv: list[str], namespace: str | None = None, container: str | None = None,
             timeout_s: float = 20.0) -> tuple[int, str]:
        """Run ``argv`` in a running container of ``pod``: (exit code, output)."""
        return self.cluster.call(self.cluster.kubelet.exec(namespace or self.namespace, pod, container, argv,
                                                           timeout_s), timeout_s + 5)
