"""Every string written in pdserve's source is valid Unicode.

A ``\\ud800`` escape in a plain (not raw) docstring makes a lone surrogate: Python 3.11
loads it, but 3.13 refuses to import the module ("surrogates not allowed"), and a
class docstring that pydantic turns into a schema description breaks the OpenAPI
document's encoding."""

from __future__ import annotations

import ast
from pathlib import Path

import pdserve

ROOT = Path(pdserve.__file__).parent


def test_every_string_constant_in_pdserve_encodes_as_utf8():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                try:
                    node.value.encode("utf-8")
                except UnicodeEncodeError as exc:
                    bad.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {exc.reason} "
                               f"at {node.value[max(0, exc.start - 20):exc.end]!r}")
    assert not bad, "\n".join(bad)
