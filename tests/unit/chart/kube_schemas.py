"""Would an apiserver of a supported Kubernetes version take this object? As far as
offline schemas can tell.

Built-in kinds: the version's OpenAPI schemas shipped in ``kubernetes-validate``
(strict: an unknown field is an error, as with ``kubectl apply --validate=strict``).
pdserve's custom resources (which kubernetes-validate has no schema for): the chart's
CRD ``openAPIV3Schema`` through ``tests.unit.api.apiserver.admit`` (defaults, OpenAPI,
CEL rules), plus unknown fields (which the apiserver would silently prune) and the
object's ``metadata`` against the version's ObjectMeta. Kinds of other projects'
CRDs have no schema here: ``UNCHECKED`` names them, and their tests check structure.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import kubernetes_validate
import yaml

from tests.unit.api.apiserver import admit

from .helm import CHART

# The chart's minimum (Chart.yaml kubeVersion) and the version CI targets.
KUBE_VERSIONS = ("1.29", "1.33")
UNCHECKED = {("monitoring.coreos.com/v1", "ServiceMonitor")}


@cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> openAPIV3Schema of every version in charts/pdserve/crds."""
    schemas = {}
    for path in sorted((CHART / "crds").glob("*.yaml")):
        crd = yaml.safe_load(Path(path).read_text())
        for version in crd["spec"]["versions"]:
            key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
            schemas[key] = version["schema"]["openAPIV3Schema"]
    return schemas


def unknown_fields(schema: dict, obj: object, path: str = "") -> list[str]:
    """Fields of ``obj`` the schema does not declare: the apiserver would drop them."""
    if isinstance(obj, list):
        return [e for i, item in enumerate(obj)
                for e in unknown_fields(schema.get("items", {}), item, f"{path}[{i}]")]
    if not isinstance(obj, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(schema.get("additionalProperties"), dict):
        return [e for key, value in obj.items()
                for e in unknown_fields(schema["additionalProperties"], value, f"{path}.{key}")]
    props = schema.get("properties", {})
    errors = [f"{path}.{key}: not in the schema (pruned)".lstrip(".") for key in obj if key not in props]
    return errors + [e for key, value in obj.items() if key in props
                     for e in unknown_fields(props[key], value, f"{path}.{key}")]


def _builtin_errors(obj: dict, version: str) -> list[str]:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.absolute_path) or "<root>"
        return [f"{where}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [exc.message]
    return []


def validation_errors(obj: dict, version: str) -> list[str]:
    """Why Kubernetes ``version`` would refuse (or silently change) ``obj``; [] if it takes it.
    Memoized: most objects (CRDs, roles, dashboards) are the same in many renders."""
    return list(_errors(json.dumps(obj, sort_keys=True), version))


@cache
def _errors(text: str, version: str) -> tuple[str, ...]:
    obj = json.loads(text)
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in UNCHECKED:
        return ()
    if key not in crd_schemas():
        return tuple(_builtin_errors(obj, version))
    schema = crd_schemas()[key]
    body = {k: v for k, v in obj.items() if k != "metadata"}
    _, errors = admit(schema, obj)
    # ObjectMeta is the apiserver's for every kind; a ConfigMap is the smallest carrier.
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata", {})}
    return (*errors, *unknown_fields(schema, body), *_builtin_errors(meta, version))
