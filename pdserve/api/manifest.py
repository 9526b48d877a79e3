"""Loading and writing PDCluster / PDInstance manifests, and the default cluster.

Owns ``load_manifest`` (a YAML file -> validated model, for ``pdserve up -f``),
``parse_manifest`` (a dict -> model, for objects from the Kubernetes API),
``ManifestError`` (messages that name the file and the field) and
``default_cluster`` (what ``pdserve up`` runs when given no file).

Invariants: a manifest that loads here is one the CRD schema accepts and vice
versa (both come from the same models); errors list every bad field, each as a
dotted camelCase path such as ``spec.prefill.replicas``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from pdserve.api.cluster import (
    KVTransferSpec,
    ModelSpec,
    PDCluster,
    PDClusterSpec,
    PoolSpec,
)
from pdserve.api.common import ObjectMeta

M = TypeVar("M", bound=BaseModel)


class ManifestError(ValueError):
    """A manifest pdserve cannot use; ``str()`` names the source and each bad field."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


def field_path(loc: tuple) -> str:
    """``("spec", "prefill", "replicas")`` -> ``spec.prefill.replicas``; list indices as ``[i]``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part:
            out += f".{part}" if out else str(part)
    return out or "<root>"


def describe_errors(exc: ValidationError) -> list[str]:
    """One line per error: the field path, what is wrong, and the value given."""
    lines = []
    for err in exc.errors(include_url=False):
        # A model validator reports at the model's path and already names the field.
        loc = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
        message = err["msg"].removeprefix("Value error, ")
        where = field_path(loc)
        # Cross-field rules' messages already start with the full field path.
        line = message if message.startswith(where) else f"{where}: {message}"
        if err["type"] not in ("missing", "value_error") and not isinstance(err["input"], dict):
            line += f" (got {err['input']!r})"
        lines.append(line)
    return lines


def parse_manifest(raw: object, model: type[M] = PDCluster, source: str = "<manifest>") -> M:
    """Validate one decoded manifest; raises ``ManifestError`` naming each field."""
    if not isinstance(raw, dict):
        raise ManifestError(source, [f"expected a mapping, got {type(raw).__name__}"])
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise ManifestError(source, describe_errors(exc)) from None


def load_manifest(path: str | Path, model: type[M] = PDCluster) -> M:
    """Load the first document of kind ``model`` from a YAML file.

    Called by ``pdserve up -f`` and the tests. A multi-document file may hold
    other kinds; documents without a ``kind`` are taken as ``model``'s kind.
    """
    path = Path(path)
    source = str(path)
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except OSError as exc:
        raise ManifestError(source, [f"cannot read: {exc.strerror or exc}"]) from None
    except yaml.YAMLError as exc:
        raise ManifestError(source, [f"not valid YAML: {exc}"]) from None
    kind = model.model_fields["kind"].default
    for doc in docs:
        if not isinstance(doc, dict) or doc.get("kind", kind) == kind:
            return parse_manifest(doc, model, source)
    found = sorted({str(d.get("kind")) for d in docs if isinstance(d, dict)})
    raise ManifestError(source, [f"no {kind} document (found: {', '.join(found) or 'none'})"])


def dump_manifest(obj: BaseModel) -> str:
    """YAML text of a model in its Kubernetes form (camelCase, no nulls)."""
    data = obj.model_dump(mode="json", by_alias=True, exclude_none=True)
    return yaml.safe_dump(data, sort_keys=False)


def default_cluster(name: str = "local", namespace: str | None = None) -> PDCluster:
    """The built-in cluster: tiny preset, 1 prefill + 1 decode, layerwise over TCP.

    What ``pdserve up`` runs without ``-f``; small enough for a laptop CPU.
    """
    return PDCluster(
        metadata=ObjectMeta(name=name, namespace=namespace),
        spec=PDClusterSpec(
            model=ModelSpec(preset="tiny"),
            prefill=PoolSpec(replicas=1),
            decode=PoolSpec(replicas=1),
            kv_transfer=KVTransferSpec(mode="layerwise", transport="tcp"),
        ),
    )
