"""Loading and writing PDCluster / PDInstance manifests, and the default cluster.

Owns ``load_manifest`` (a YAML file -> validated model, for ``pdserve up -f``),
``parse_manifest`` (a dict -> model, for objects from the Kubernetes API),
``ManifestError`` (messages that name the file and the field) and
``default_cluster`` (what ``pdserve up`` runs when given no file).

Invariants: a manifest that loads here is one the CRD schema accepts and vice
versa (both come from the same models); errors list every bad field, each as a
dotted camelCase path such as ``spec.prefill.replicas``, with the value given;
an unknown field or a value outside a fixed set also gets a hint (``hints``, one
per problem, "" for none): the closest allowed name ("did you mean 'replicas'?")
and what is allowed there.
"""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from pdserve.api.cluster import (
    EngineSpec,
    KVTransferSpec,
    ModelSpec,
    PDCluster,
    PDClusterSpec,
    PoolSpec,
)
from pdserve.api.common import ObjectMeta

M = TypeVar("M", bound=BaseModel)


class ManifestError(ValueError):
    """A manifest pdserve cannot use; ``str()`` names the source and each bad field.

    ``problems`` are one line per bad field (the operator writes them into the
    cluster's status); ``hints`` go with them, index by index ("" where none)."""

    def __init__(self, source: str, problems: list[str], hints: list[str] | None = None):
        self.source = source
        self.problems = problems
        self.hints = list(hints or [])
        self.hints += [""] * (len(problems) - len(self.hints))
        super().__init__(f"{source}: " + "; ".join(self.lines()))

    def lines(self) -> list[str]:
        """Each problem with its hint, as a user reads them."""
        return [f"{p}; {h}" if h else p for p, h in zip(self.problems, self.hints, strict=True)]

    def explain(self) -> str:
        """The whole message on one line per problem; what ``pdserve`` prints after ``error:``."""
        lines = self.lines()
        if len(lines) == 1:
            return f"{self.source}: {lines[0]}"
        return f"{self.source}: {len(lines)} problems\n" + "\n".join(f"  {line}" for line in lines)


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


def closest(word: str, choices: list[str]) -> str | None:
    """The choice ``word`` was most likely meant to be (case-insensitive), or None."""
    by_lower = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[match[0]] if match else None


def _field_type(model: type[BaseModel], loc: tuple) -> object:
    """The declared type at ``loc`` inside ``model`` (through models, lists, dicts and
    optionals; fields by their camelCase alias or Python name), or None if not found."""
    tp: object = model
    for part in loc:
        tp = _step(tp, part)
        if tp is None:
            return None
    return tp


def _step(tp: object, part: object) -> object:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        for name, info in tp.model_fields.items():
            if part in (name, info.alias):
                return info.annotation
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, tuple) and args:
        return args[0]
    if origin is dict and len(args) == 2:
        return args[1]
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        members = args[:1] if origin is typing.Annotated else args
        return next((t for t in (_step(a, part) for a in members if a is not type(None)) if t), None)
    return None


def _literal_values(tp: object) -> list:
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    return [v for a in typing.get_args(tp) for v in _literal_values(a)]


def hint_for(err: dict, model: type[BaseModel]) -> str:
    """What to write instead, for an unknown field or a value outside a fixed set; ""
    when pydantic's message says it all."""
    loc = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
    if err["type"] == "extra_forbidden" and loc:
        parent = _field_type(model, loc[:-1])
        if not (isinstance(parent, type) and issubclass(parent, BaseModel)):
            return ""
        allowed = [info.alias or name for name, info in parent.model_fields.items()]
        guess = closest(str(loc[-1]), allowed)
        known = f"fields allowed here: {', '.join(allowed)}"
        return f"did you mean {guess!r}? ({known})" if guess else f"unknown field ({known})"
    if err["type"] == "literal_error" and isinstance(err["input"], str):
        values = _literal_values(_field_type(model, loc))
        guess = closest(str(err["input"]), [str(v) for v in values])
        return f"did you mean {guess!r}?" if guess else ""
    return ""


def parse_manifest(raw: object, model: type[M] = PDCluster, source: str = "<manifest>") -> M:
    """Validate one decoded manifest; raises ``ManifestError`` naming each field."""
    if not isinstance(raw, dict):
        raise ManifestError(source, [f"expected a mapping, got {type(raw).__name__}"])
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        hints = [hint_for(err, model) for err in exc.errors(include_url=False)]
        raise ManifestError(source, describe_errors(exc), hints) from None


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
    guess = closest(found[0], [kind]) if len(found) == 1 else None
    raise ManifestError(source, [f"no {kind} document (found: {', '.join(found) or 'none'})"],
                        [f"did you mean kind: {guess}?" if guess else ""])


def dump_manifest(obj: BaseModel) -> str:
    """YAML text of a model in its Kubernetes form (camelCase, no nulls)."""
    data = obj.model_dump(mode="json", by_alias=True, exclude_none=True)
    return yaml.safe_dump(data, sort_keys=False)


def default_cluster(name: str = "local", namespace: str | None = None) -> PDCluster:
    """The built-in cluster: the ``smollm2`` preset (a real 135M-parameter instruct
    model, served in float32: dtype ``auto``), 1 prefill + 1 decode, layerwise over TCP,
    each engine with KV room for one request of the model's whole 8,192 tokens
    (45 KiB per token in float32: 512 MiB).

    What ``pdserve up`` runs without ``-f``; small enough for a laptop CPU.
    """
    return PDCluster(
        metadata=ObjectMeta(name=name, namespace=namespace),
        spec=PDClusterSpec(
            model=ModelSpec(preset="smollm2"),
            engine=EngineSpec(kv_cache_bytes="512Mi"),
            prefill=PoolSpec(replicas=1),
            decode=PoolSpec(replicas=1),
            kv_transfer=KVTransferSpec(mode="layerwise", transport="tcp"),
        ),
    )
