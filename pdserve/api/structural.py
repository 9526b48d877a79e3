"""Pydantic JSON schema -> Kubernetes structural OpenAPI v3 schema.

Owns ``to_structural`` (the converter), ``structural_violations`` (the checker the
CRD generator and the tests run on its output) and ``apply_defaults`` (what the
apiserver does with ``default`` before validation, for tests and local tools).

The conversion: ``$ref`` inlined; ``title``, ``$defs`` and ``examples`` dropped;
``Optional[X]`` (``anyOf [X, null]``) becomes plain ``X`` left out of
``required`` (the apiserver prunes nulls for non-nullable fields, so ``has()`` in
CEL means "set"); ``int | quantity-string`` becomes ``x-kubernetes-int-or-string``;
``const`` becomes a one-value ``enum``; draft-2020 ``exclusiveMinimum: n`` becomes
OpenAPI v3.0 ``minimum: n, exclusiveMinimum: true``; ``additionalProperties:
false`` (pydantic's ``extra="forbid"``) is dropped, so ``additionalProperties``
remains only on real maps; a non-optional nested object without a default gets
``default: {}`` so the apiserver fills in the defaults inside it.

Invariants: pure functions over plain dicts; inputs are never mutated.
"""

from __future__ import annotations

import copy
from typing import Any

_DROPPED = {"title", "$defs", "examples", "discriminator"}
# Keywords the apiserver refuses or that make a schema non-structural.
_FORBIDDEN = {"$ref", "$defs", "title", "const", "allOf", "oneOf", "not", "prefixItems", "examples"}


def to_structural(schema: dict) -> dict:
    """The structural form of a pydantic ``model_json_schema(by_alias=True)``."""
    return _convert(schema, schema.get("$defs", {}))


def _resolve(node: dict, defs: dict) -> dict:
    while "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        node = {**defs[name], **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def _unwrap_optional(node: dict) -> tuple[dict, bool]:
    """``anyOf [X, null]`` -> (X merged with the outer keywords, True)."""
    options = node.get("anyOf")
    if not options or {"type": "null"} not in options:
        return node, False
    rest = [o for o in options if o != {"type": "null"}]
    outer = {k: v for k, v in node.items() if k != "anyOf"}
    if outer.get("default", 0) is None:
        del outer["default"]
    inner = rest[0] if len(rest) == 1 else {"anyOf": rest}
    return {**inner, **outer}, True


def _convert(node: Any, defs: dict) -> Any:
    if not isinstance(node, dict):
        return node
    node = _resolve(node, defs)
    node, _ = _unwrap_optional(node)
    node = _resolve(node, defs)
    out: dict = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key == "properties":
            out[key] = _convert_properties(value, set(node.get("required", [])), defs)
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = _convert(value, defs)
        elif key == "items":
            out[key] = _convert(value, defs)
        elif key == "const":
            out["enum"] = [value]
        elif key == "exclusiveMinimum" and not isinstance(value, bool):
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum" and not isinstance(value, bool):
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "description":
            out[key] = value.replace("``", "`")
        elif key == "anyOf":
            out[key] = [_convert(option, defs) for option in value]
        else:
            out[key] = copy.deepcopy(value)
    if out.get("x-kubernetes-int-or-string"):
        _fold_int_or_string(out)
    return {k: out[k] for k in sorted(out, key=_key_order)}


_FIRST = ("type", "description")
_LAST = ("properties", "additionalProperties", "items", "required", "x-kubernetes-validations")


def _key_order(key: str) -> tuple[int, int, str]:
    """Readable generated YAML: type and description first, nested schemas last."""
    if key in _FIRST:
        return (0, _FIRST.index(key), key)
    if key in _LAST:
        return (2, _LAST.index(key), key)
    return (1, 0, key)


def _convert_properties(props: dict, required: set[str], defs: dict) -> dict:
    out = {}
    for name, prop in props.items():
        unwrapped, was_optional = _unwrap_optional(_resolve(prop, defs))
        converted = _convert(unwrapped, defs)
        is_object = converted.get("type") == "object" and "properties" in converted
        if is_object and not was_optional and name not in required and "default" not in converted:
            converted["default"] = {}
        out[name] = converted
    return out


def _fold_int_or_string(node: dict) -> None:
    """controller-gen's form: bare integer/string branches, the pattern on top."""
    for option in node.get("anyOf", []):
        if "pattern" in option:
            node["pattern"] = option["pattern"]
    node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    node.pop("type", None)


def structural_violations(schema: Any, path: str = "") -> list[str]:
    """Why ``schema`` is not a structural schema the apiserver accepts; [] if it is."""
    if not isinstance(schema, dict):
        return [f"{path or '<root>'}: schema is not an object"]
    where = path or "<root>"
    problems = [f"{where}: keyword {k!r} is not allowed" for k in _FORBIDDEN & schema.keys()]
    int_or_string = schema.get("x-kubernetes-int-or-string") is True
    if "anyOf" in schema and not int_or_string:
        problems.append(f"{where}: anyOf is only allowed for x-kubernetes-int-or-string")
    if int_or_string and "type" in schema:
        problems.append(f"{where}: x-kubernetes-int-or-string must not set type")
    untyped_ok = int_or_string or schema.get("x-kubernetes-preserve-unknown-fields") is True
    if "type" not in schema and not untyped_ok:
        problems.append(f"{where}: missing type")
    if schema.get("type") == "null" or ("default" in schema and schema["default"] is None):
        problems.append(f"{where}: null type or null default")
    if "additionalProperties" in schema:
        if not isinstance(schema["additionalProperties"], dict):
            problems.append(f"{where}: additionalProperties must be a schema")
        if "properties" in schema:
            problems.append(f"{where}: properties and additionalProperties together")
    if schema.get("uniqueItems") is True:
        problems.append(f"{where}: uniqueItems true is not allowed")
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in schema and not isinstance(schema[key], bool):
            problems.append(f"{where}: {key} must be a boolean in OpenAPI v3.0")
    if schema.get("type") == "array" and "items" not in schema:
        problems.append(f"{where}: array without items")
    if schema.get("x-kubernetes-list-type") == "map":
        keys = set(schema.get("x-kubernetes-list-map-keys", []))
        if not keys or not keys <= set(schema.get("items", {}).get("required", [])):
            problems.append(f"{where}: list-type map needs required list-map-keys")
    for name, prop in schema.get("properties", {}).items():
        problems += structural_violations(prop, f"{path}.{name}")
    if isinstance(schema.get("additionalProperties"), dict):
        problems += structural_violations(schema["additionalProperties"], f"{path}[*]")
    if "items" in schema:
        problems += structural_violations(schema["items"], f"{path}[]")
    return problems


def apply_defaults(schema: dict, obj: Any) -> Any:
    """``obj`` with schema defaults filled in, top-down, as the apiserver does."""
    if not isinstance(obj, dict | list):
        return obj
    if isinstance(obj, list):
        items = schema.get("items", {})
        return [apply_defaults(items, item) for item in obj]
    out = dict(obj)
    for name, prop in schema.get("properties", {}).items():
        if name not in out and "default" in prop:
            out[name] = copy.deepcopy(prop["default"])
        if name in out:
            out[name] = apply_defaults(prop, out[name])
    if isinstance(schema.get("additionalProperties"), dict):
        for key, value in out.items():
            out[key] = apply_defaults(schema["additionalProperties"], value)
    return out
