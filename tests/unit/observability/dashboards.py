"""Reading the shipped Grafana dashboards: their panels' PromQL and template variables.

Shared by the schema test here and the integration test that runs every expression
against a real Prometheus.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARDS = Path(__file__).resolve().parents[3] / "charts" / "pdserve" / "dashboards"
SCHEMA = Path(__file__).with_name("grafana_dashboard.schema.json")
LABEL_VALUES = re.compile(r"^label_values\((.+),\s*(\w+)\)$")
# What Grafana would put for its built-ins when the test evaluates an expression.
BUILTINS = {"$__rate_interval": "20s", "$__interval": "5s", "$__range": "1m"}


def load_all() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def variables(dashboard: dict) -> list[dict]:
    return dashboard["templating"]["list"]


def substitute(expr: str, values: dict[str, str]) -> str:
    """``expr`` with Grafana built-ins and ``$var`` / ``${var}`` replaced by ``values``."""
    for name, value in BUILTINS.items():
        expr = expr.replace(name, value)
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    assert "$" not in expr, f"unresolved variable in {expr}"
    return expr


def label_values_query(variable: dict) -> tuple[str, str]:
    """(series selector, label) of a ``label_values(selector, label)`` query variable."""
    m = LABEL_VALUES.match(variable["definition"])
    assert m, f"variable {variable['name']}: only label_values(selector, label) is used"
    return m.group(1), m.group(2)
