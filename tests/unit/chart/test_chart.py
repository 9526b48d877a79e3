"""The Helm chart through the real helm: lint, the values schema, the CRDs, RBAC, NOTES.

What the files alone can tell is checked from the files (every ``.Values`` path a
template reads is in values.yaml and in values.schema.json; the CRDs are the
generated ones); everything else from what ``helm template`` / ``helm install
--dry-run=client`` print (fixture ``helm``). Rendering with many value sets and
checking each object is in test_render.py; schema validity in test_objects_valid.py.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import yaml

from pdserve.api.crd import render_crd_files
from pdserve.operator import builders as b
from pdserve.operator.kube import KINDS

from .cluster_objects import EXAMPLES, MINIMAL, chart_settings, load_example, operator_objects
from .helm import CHART, NAMESPACE, HelmError
from .value_sets import VALUE_SETS

TEMPLATES = sorted(CHART.glob("templates/*"))
YAML_TEMPLATES = [p for p in TEMPLATES if p.suffix == ".yaml"]
VALUES_PATH = re.compile(r"\$?\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
# (values over values.yaml, what helm's schema check says about them)
BAD_VALUES = [
    ({"operator": {"replicas": 2}}, "at '/operator/replicas': maximum: got 2, want 1"),
    ({"etcd": {"enabled": False, "endpoints": []}}, "at '/etcd/endpoints': minItems: got 0, want 1"),
    ({"operatr": {}}, "additional properties 'operatr' not allowed"),
    ({"image": {"repository": "x", "tag": "1", "pullPolicy": "Sometimes"}},
     "at '/image/pullPolicy': value must be one of"),
]


@pytest.fixture(scope="module")
def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


@pytest.fixture(scope="module")
def values_schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def schema_has_path(schema: dict, parts: list[str]) -> bool:
    node = schema
    for part in parts:
        if "$ref" in node:
            node = node_at(schema, node["$ref"])
        node = node.get("properties", {}).get(part)
        if node is None:
            return False
    return True


def node_at(root: dict, ref: str) -> dict:
    for part in ref.removeprefix("#/").split("/"):
        root = root[part]
    return root


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "pdserve"
    assert (CHART / "dashboards").is_dir()


def test_helm_lint_passes_strict(helm):
    out = helm.lint()
    assert "1 chart(s) linted, 0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out


def test_values_validate_against_schema(values, values_schema):
    jsonschema.Draft7Validator.check_schema(values_schema)
    jsonschema.validate(values, values_schema)


@pytest.mark.parametrize("bad", [v for v, _ in BAD_VALUES])
def test_schema_rejects_bad_values(values, values_schema, bad):
    merged = {**values, **{k: {**values.get(k, {}), **v} for k, v in bad.items()}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(merged, values_schema)


@pytest.mark.parametrize(("bad", "message"), BAD_VALUES)
def test_helm_refuses_bad_values_naming_the_field(helm, bad, message):
    with pytest.raises(HelmError) as template:
        helm.template(bad)
    assert "values don't meet the specifications of the schema" in template.value.output
    assert message in template.value.output
    with pytest.raises(HelmError) as lint:
        helm.lint(bad)
    assert message in lint.value.output and "1 chart(s) failed" in lint.value.output


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
def test_every_template_renders_objects(helm, path):
    """Some value set renders objects from each template, and each is a Kubernetes object."""
    source = f"templates/{path.name}"
    docs = [d for v in VALUE_SETS.values() for d in helm.template(v).from_source(source)]
    assert docs, f"{path.name} renders nothing"
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), doc


def test_operator_runs_pdserve_operator_as_non_root(helm):
    deployment = helm.template().get("Deployment", "r-pdserve-operator")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["args"] == ["operator"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


def _grants(role: dict) -> dict[tuple[str, str], set[str]]:
    return {(g, r): set(rule["verbs"]) for rule in role["rules"]
            for g in rule["apiGroups"] for r in rule["resources"]}


def test_operator_rbac_is_least_privilege(helm):
    role = helm.template().get("ClusterRole", "r-pdserve-operator")
    grants = _grants(role)
    assert {"watch", "patch"} <= grants[("pdserve.io", "pdclusters")]
    assert {"patch"} <= grants[("pdserve.io", "pdclusters/status")]
    assert grants[("pdserve.io", "pdinstances/finalizers")] == {"update"}
    # PDPools: created, synced both ways and their status written; their scale
    # subresource is the autoscalers' (their own roles grant */scale), never the operator's
    assert {"create", "watch", "patch"} <= grants[("pdserve.io", "pdpools")]
    assert {"patch"} <= grants[("pdserve.io", "pdpools/status")]
    assert ("pdserve.io", "pdpools/scale") not in grants
    assert {"create", "delete"} <= grants[("", "pods")] & grants[("apps", "deployments")]
    assert grants[("", "events")] == {"create", "patch"}
    assert grants[("apiextensions.k8s.io", "customresourcedefinitions")] == {"get", "list", "watch"}
    # Ready reads the Coordinator Service's EndpointSlices (v1 Endpoints are deprecated)
    assert grants[("discovery.k8s.io", "endpointslices")] == {"get", "list", "watch"}
    assert ("", "endpoints") not in grants
    for prefix, plural in KINDS.values():  # every kind the operator's client touches
        assert ("" if prefix == "api/v1" else prefix.split("/")[1], plural) in grants, plural
    # the clusters' token Secrets are created and deleted, never read
    assert grants[("", "secrets")] == {"create", "delete"} and ("", "nodes") not in grants
    assert not any({"bind", "escalate", "impersonate"} & verbs for verbs in grants.values())
    assert not any(g == "rbac.authorization.k8s.io" for g, _ in grants)
    assert all("*" not in verbs for verbs in grants.values())
    assert not any("*" in key for g_r in grants for key in g_r)


def test_the_operator_reads_one_secret_its_key_in_its_namespace(helm):
    rendered = helm.template()
    settings = chart_settings(rendered, NAMESPACE)
    role = rendered.get("Role", "r-pdserve-operator-key")
    assert role["metadata"]["namespace"] == NAMESPACE == settings.operator_namespace
    [read] = [r for r in role["rules"] if "get" in r["verbs"]]
    assert (read["resources"], read["verbs"], read["resourceNames"]) == (
        ["secrets"], ["get"], [settings.key_secret])
    binding = rendered.get("RoleBinding", "r-pdserve-operator-key")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "r-pdserve-operator-key"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "r-pdserve", "namespace": NAMESPACE}]


def _operator_role(rendered, values: dict) -> dict:
    watched = values.get("operator", {}).get("watchNamespace")
    return rendered.get("Role" if watched else "ClusterRole", "r-pdserve-operator")


CREATE_ONLY = {"Secret"}  # created (and deleted) blind: the operator never reads one


@pytest.mark.parametrize("values", ["defaults", "namespaced"])
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_operator_may_do_what_it_does(helm, example, values):
    """The operator's role grants every write reconcile makes for a cluster (in the
    watched namespace, when it watches one), and nothing binds a role to the
    cluster's components: none of them calls the Kubernetes API."""
    values = VALUE_SETS[values]
    rendered = helm.template(values)
    grants = _grants(_operator_role(rendered, values))
    crud = {"get", "list", "watch", "create", "patch", "delete"}
    watched = values.get("operator", {}).get("watchNamespace")
    objects = operator_objects(load_example(example, watched or "default"),
                               chart_settings(rendered, NAMESPACE))
    for obj in objects:
        group = obj["apiVersion"].rpartition("/")[0]
        needed = {"create", "delete"} if obj["kind"] in CREATE_ONLY else crud
        assert needed <= grants[(group, obj["kind"].lower() + "s")], obj["kind"]
    assert not [o for o in objects if o["kind"] in ("ServiceAccount", "RoleBinding", "Role")]
    for pod_spec in [o["spec"] for o in objects if o["kind"] == "Pod"] + [
            o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"]:
        assert pod_spec["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in pod_spec


def test_watching_one_namespace_grants_nothing_cluster_wide(helm):
    rendered = helm.template(VALUE_SETS["namespaced"])
    assert not rendered.of_kind("ClusterRole") and not rendered.of_kind("ClusterRoleBinding")
    role, binding = rendered.get("Role", "r-pdserve-operator"), rendered.get("RoleBinding", "r-pdserve-operator")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "team-a"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "r-pdserve-operator"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "r-pdserve", "namespace": NAMESPACE}]
    assert ("apiextensions.k8s.io", "customresourcedefinitions") not in _grants(role)
    assert _grants(role) == {k: v for k, v in _grants(helm.template().get(
        "ClusterRole", "r-pdserve-operator")).items() if k[0] != "apiextensions.k8s.io"}


def test_dashboards_are_labelled_configmaps_from_files(helm):
    text = (CHART / "templates" / "dashboards.yaml").read_text()
    assert '.Files.Glob "dashboards/*.json"' in text
    files = sorted(CHART.glob("dashboards/*.json"))
    configmaps = helm.template().from_source("templates/dashboards.yaml")
    assert len(configmaps) == len(files) > 0
    for path, configmap in zip(files, configmaps, strict=True):
        assert configmap["kind"] == "ConfigMap"
        assert configmap["metadata"]["name"] == f"r-pdserve-dashboard-{path.stem}"
        assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(configmap["data"][path.name]) == json.loads(path.read_text())


def test_chart_crds_are_the_generated_ones():
    for name, text in render_crd_files().items():
        assert (CHART / "crds" / name).read_text() == text


@pytest.mark.parametrize("values", [{}, VALUE_SETS["namespaced"]], ids=["all-namespaces", "namespaced"])
def test_notes_tell_the_next_commands(helm, values):
    notes = helm.notes(values)
    for command in ("kubectl apply", "kubectl get pdc", "port-forward", "/v1/completions"):
        assert command in notes
    # the cluster to create is in the notes (a chart cannot point at the repository's files)
    heredoc = re.search(r"kubectl apply(?P<ns> -n \S+)? -f - <<'EOF'\n(?P<doc>.*?)\nEOF\n", notes, re.S)
    assert heredoc, notes
    assert yaml.safe_load(heredoc["doc"]) == yaml.safe_load(MINIMAL.read_text())
    watched = values.get("operator", {}).get("watchNamespace")
    assert heredoc["ns"] == (f" -n {watched}" if watched else None)
    # the names the commands use are the operator's for that cluster
    cluster = load_example(MINIMAL, watched or "default")
    [coordinator] = [s for s in b.build_services(cluster)
                     if s["metadata"]["labels"][b.COMPONENT_LABEL] == "coordinator"]
    port = coordinator["spec"]["ports"][0]["port"]
    assert f"svc/{coordinator['metadata']['name']} {port}:{port}" in notes
    assert f"-l {b.CLUSTER_LABEL}={cluster.metadata.name}" in notes
