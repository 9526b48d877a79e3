"""The shipped dashboards are valid Grafana dashboard JSON (a schema for the subset we
use) and well formed: unique panel ids, no overlapping panels, every query through the
``$datasource`` variable, every variable used and defined."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.unit.observability.dashboards import SCHEMA, load_all, panels, variables

DASHBOARDS = load_all()


def test_the_three_dashboards_ship():
    assert set(DASHBOARDS) == {"pdserve-overview.json", "pdserve-pd-kv-transfer.json",
                               "pdserve-control-plane.json"}
    assert len({d["uid"] for d in DASHBOARDS.values()}) == len(DASHBOARDS)


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_matches_the_dashboard_schema(name):
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(DASHBOARDS[name], schema, cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_ids_layout_and_datasource(name):
    board = DASHBOARDS[name]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
    for p in panels(board):
        refs = [p["datasource"], *(t["datasource"] for t in p["targets"])]
        assert all(r["uid"] == "${datasource}" for r in refs), p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_variables_are_defined_and_used(name):
    board = DASHBOARDS[name]
    defined = {v["name"] for v in variables(board)}
    assert {"datasource", "namespace"} <= defined
    text = json.dumps(board["panels"]) + json.dumps(variables(board))
    used = set(re.findall(r"\$\{?([a-z_]+)", text)) - {"__rate_interval", "__interval", "__range", "__all"}
    assert used == defined


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_metric_names_follow_the_scheme(name):
    for p in panels(DASHBOARDS[name]):
        for t in p["targets"]:
            for metric in re.findall(r"\b(pdserve_\w+)", t["expr"]):
                assert re.fullmatch(r"pdserve_(engine|coordinator|controller|nodeagent|operator)_\w+",
                                    metric), metric
