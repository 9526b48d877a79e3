"""What the operator, as the chart deploys it, builds for a PDCluster.

``chart_settings`` reads ``OperatorSettings`` from the environment of the chart's
operator Deployment, exactly as ``pdserve operator`` does (``OperatorSettings.from_env``);
``operator_objects`` is the operator's own list (``pdserve.operator.desired.
build_cluster_objects``): the static objects reconcile applies, the token Secret, one
PDInstance and one engine Pod per desired instance.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from pdserve.api import PDCluster
from pdserve.api.manifest import parse_manifest
from pdserve.operator import builders as b
from pdserve.operator.desired import build_cluster_objects
from pdserve.operator.settings import OperatorSettings

from .helm import CHART

EXAMPLES = sorted((CHART.parents[1] / "examples").glob("*.yaml"))
MINIMAL = CHART.parents[1] / "examples" / "minimal.yaml"
VLLM_GPU = CHART.parents[1] / "examples" / "vllm-pd-gpu.yaml"


def load_example(path: Path, namespace: str = "default", **spec) -> PDCluster:
    """An example (with ``spec`` keys replaced) as the apiserver stores it: ``kubectl
    apply`` puts it in a namespace (the current context's, ``default``, unless the file
    names one) and gives it a uid."""
    raw = yaml.safe_load(path.read_text())
    meta = raw["metadata"]
    raw["metadata"] = {**meta, "namespace": meta.get("namespace", namespace),
                       "uid": f"uid-{meta['name']}", "generation": 1}
    raw["spec"] = {**raw["spec"], **spec}
    return parse_manifest(raw, PDCluster, str(path))


def operator_container(rendered) -> dict:
    [deployment] = [d for d in rendered.of_kind("Deployment")
                    if d["metadata"]["labels"].get("app.kubernetes.io/component") == "operator"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


def chart_settings(rendered, namespace: str) -> OperatorSettings:
    """The operator's settings in a release rendered into ``namespace``."""
    env = {}
    for var in operator_container(rendered)["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace":
            env[var["name"]] = namespace
    return OperatorSettings.from_env(env)


def operator_objects(cluster: PDCluster, settings: OperatorSettings) -> list[dict]:
    uids = {name: f"uid-{name}" for name in b.desired_instances(cluster)}
    return build_cluster_objects(cluster, settings, "t" * 64, uids)
