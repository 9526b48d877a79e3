"""The Helm chart, checked without helm: values, schema, templates, RBAC, CRDs.

No helm binary runs here, so templates are kept to value substitution and
simple if/range/with/toYaml, and these tests check what can be checked from
the files: every ``.Values`` path a template reads exists in values.yaml and
in values.schema.json; values.yaml validates against the schema; each template
parses as YAML once every ``{{ ... }}`` is replaced by a placeholder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from pdserve.api.crd import render_crd_files

CHART = Path(__file__).resolve().parents[3] / "charts" / "pdserve"
TEMPLATES = sorted(CHART.glob("templates/*"))
YAML_TEMPLATES = [p for p in TEMPLATES if p.suffix == ".yaml"]
VALUES_PATH = re.compile(r"\$?\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
CONTROL = re.compile(r"^\s*\{\{-?\s*((if|else|end|range|with|define)\b|\$\w+\s*:=).*\}\}\s*$")
INDENTED = re.compile(r"^\s*\{\{-?[^}]*\|\s*n?indent\s+(\d+)\s*-?\}\}\s*$")
ANY_ACTION = re.compile(r"\{\{-?.*?-?\}\}")


@pytest.fixture(scope="module")
def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


@pytest.fixture(scope="module")
def values_schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def substitute(text: str) -> str:
    """A template with control lines dropped and every action made a placeholder."""
    lines = []
    for line in text.splitlines():
        if CONTROL.match(line):
            continue
        indented = INDENTED.match(line)
        if indented:
            lines.append(" " * int(indented.group(1)) + "placeholder: PLACEHOLDER")
            continue
        lines.append(ANY_ACTION.sub("PLACEHOLDER", line))
    return "\n".join(lines)


def rendered(name: str) -> list[dict]:
    docs = yaml.safe_load_all(substitute((CHART / "templates" / name).read_text()))
    return [d for d in docs if d]


def schema_has_path(schema: dict, parts: list[str]) -> bool:
    node = schema
    for part in parts:
        if "$ref" in node:
            node = node_at(node["$ref"])
        node = node.get("properties", {}).get(part)
        if node is None:
            return False
    return True


def node_at(ref: str) -> dict:
    root = json.loads((CHART / "values.schema.json").read_text())
    for part in ref.removeprefix("#/").split("/"):
        root = root[part]
    return root


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "pdserve"
    assert (CHART / "dashboards").is_dir()


def test_values_validate_against_schema(values, values_schema):
    jsonschema.Draft7Validator.check_schema(values_schema)
    jsonschema.validate(values, values_schema)


@pytest.mark.parametrize("bad", [
    {"operator": {"replicas": 2}},
    {"etcd": {"enabled": False, "endpoints": []}},
    {"operatr": {}},
    {"image": {"repository": "x", "tag": "1", "pullPolicy": "Sometimes"}},
])
def test_schema_rejects_bad_values(values, values_schema, bad):
    merged = {**values, **{k: {**values.get(k, {}), **v} for k, v in bad.items()}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(merged, values_schema)


def test_every_values_path_in_templates_exists(values, values_schema):
    used = {m.group(1).lstrip(".") for p in TEMPLATES for m in VALUES_PATH.finditer(p.read_text())}
    assert used, "no .Values references found"
    for path in sorted(used):
        node = values
        for part in path.split("."):
            assert isinstance(node, dict) and part in node, f".Values.{path} not in values.yaml"
            node = node[part]
        assert schema_has_path(values_schema, path.split(".")), f".Values.{path} not in schema"


@pytest.mark.parametrize("path", YAML_TEMPLATES, ids=lambda p: p.name)
def test_template_parses_as_yaml_after_substitution(path):
    docs = rendered(path.name)
    assert docs, f"{path.name} renders nothing"
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), doc


def test_operator_runs_pdserve_operator_as_non_root():
    deployment = next(d for d in rendered("operator.yaml") if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"] == ["operator"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False


def test_operator_rbac_is_least_privilege():
    role = next(d for d in rendered("rbac.yaml") if d["metadata"]["name"].endswith("-operator")
                and d["kind"] == "ClusterRole")
    grants = {(g, r): set(rule["verbs"]) for rule in role["rules"]
              for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"watch", "patch"} <= grants[("pdserve.io", "pdclusters")]
    assert {"patch"} <= grants[("pdserve.io", "pdclusters/status")]
    assert grants[("pdserve.io", "pdinstances/finalizers")] == {"update"}
    assert {"create", "delete"} <= grants[("", "pods")] & grants[("apps", "deployments")]
    assert grants[("", "events")] == {"create", "patch"}
    assert grants[("apiextensions.k8s.io", "customresourcedefinitions")] == {"get", "list", "watch"}
    assert ("", "secrets") not in grants and ("", "nodes") not in grants
    assert all("*" not in verbs for verbs in grants.values())
    assert not any("*" in key for g_r in grants for key in g_r)


def test_dashboards_are_labelled_configmaps_from_files():
    text = (CHART / "templates" / "dashboards.yaml").read_text()
    assert '.Files.Glob "dashboards/*.json"' in text
    [configmap] = rendered("dashboards.yaml")
    assert configmap["kind"] == "ConfigMap"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_chart_crds_are_the_generated_ones():
    for name, text in render_crd_files().items():
        assert (CHART / "crds" / name).read_text() == text


def test_notes_tell_the_next_commands():
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    for command in ("kubectl apply -f examples/", "kubectl get pdc", "port-forward",
                    "/v1/completions"):
        assert command in notes


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_template_blocks_are_balanced(path):
    actions = re.findall(r"\{\{-?\s*(\w+)", path.read_text())
    openers = sum(a in ("if", "range", "with", "define") for a in actions)
    assert openers == actions.count("end"), f"{path.name}: {openers} blocks, {actions.count('end')} ends"
