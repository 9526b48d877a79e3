"""What the apiserver does with a custom resource, as far as tests can repeat it.

Defaulting (``apply_defaults``), OpenAPI validation (``jsonschema``'s Draft 4
validator: OpenAPI v3.0 keeps draft 4's boolean ``exclusiveMinimum``) and the
CEL ``x-kubernetes-validations`` rules (``cel-python``). Each error is one line
that starts with the field path, like kubectl's.
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


def cel_errors(schema: dict, obj, path: str = "") -> list[str]:
    """Evaluate every CEL rule whose node is present in ``obj``."""
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = _CEL.program(_CEL.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(obj)}):
            where = path + rule.get("fieldPath", "")
            errors.append(f"{where.lstrip('.') or '<root>'}: {rule['message']}")
    if isinstance(obj, dict):
        for name, prop in schema.get("properties", {}).items():
            if name in obj:
                errors += cel_errors(prop, obj[name], f"{path}.{name}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in obj.items():
                errors += cel_errors(extra, value, f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            errors += cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def admit(schema: dict, obj: dict) -> tuple[dict, list[str]]:
    """Default, then validate: (the stored object, errors). CEL runs only on a valid shape."""
    defaulted = apply_defaults(schema, obj)
    errors = schema_errors(schema, defaulted)
    if not errors:
        errors = cel_errors(schema, defaulted)
    return defaulted, errors
