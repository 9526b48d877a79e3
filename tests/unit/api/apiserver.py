"""What the apiserver does with a custom resource, as far as tests can repeat it.

Defaulting (``apply_defaults``), OpenAPI validation (``jsonschema``'s Draft 4
validator: OpenAPI v3.0 keeps draft 4's boolean ``exclusiveMinimum``) and the
CEL ``x-kubernetes-validations`` rules (``cel-python``; transition rules, those
reading ``oldSelf``, on updates only). Each error is one line that starts with the
field path, like kubectl's.
"""

from __future__ import annotations

import celpy
import jsonschema

from pdserve.api.structural import apply_defaults

_CEL = celpy.Environment()


def _path(parts) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


def schema_errors(schema: dict, obj: dict) -> list[str]:
    validator = jsonschema.Draft4Validator(schema)
    return [f"{_path(e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]


_ABSENT = object()  # no old value: a create, or a node the old object lacks


def cel_errors(schema: dict, obj, path: str = "", old=_ABSENT) -> list[str]:
    """Evaluate every CEL rule whose node is present in ``obj``. A transition rule (one
    that reads ``oldSelf``) runs only where ``old`` has the node too: on an update, as
    the apiserver does (list items are not correlated here: no list-map keys)."""
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        is_transition = "oldSelf" in rule["rule"]
        if is_transition and old is _ABSENT:
            continue
        activation = {"self": celpy.json_to_cel(obj)}
        if is_transition:
            activation["oldSelf"] = celpy.json_to_cel(old)
        program = _CEL.program(_CEL.compile(rule["rule"]))
        if not program.evaluate(activation):
            where = path + rule.get("fieldPath", "")
            errors.append(f"{where.lstrip('.') or '<root>'}: {rule['message']}")
    if isinstance(obj, dict):
        olds = old if isinstance(old, dict) else {}
        for name, prop in schema.get("properties", {}).items():
            if name in obj:
                errors += cel_errors(prop, obj[name], f"{path}.{name}", olds.get(name, _ABSENT))
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in obj.items():
                errors += cel_errors(extra, value, f"{path}.{key}", olds.get(key, _ABSENT))
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            errors += cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def admit(schema: dict, obj: dict, old: dict | None = None) -> tuple[dict, list[str]]:
    """Default, then validate: (the stored object, errors). CEL runs only on a valid shape;
    ``old``: the stored object an update replaces (transition rules compare with it)."""
    defaulted = apply_defaults(schema, obj)
    errors = schema_errors(schema, defaulted)
    if not errors:
        errors = cel_errors(schema, defaulted, old=_ABSENT if old is None else apply_defaults(schema, old))
    return defaulted, errors
