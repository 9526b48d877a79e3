"""Every object the operator builds for each example (examples/*.yaml), under the
settings the chart gives it, is one a Kubernetes apiserver of each supported version
takes: Pods, Services, Deployments, the ConfigMaps, the token Secret and the
PodDisruptionBudgets against the versions' OpenAPI schemas (strict), PDInstances
and PDPools against the chart's CRDs. Both etcd set-ups are covered (the Controller's replicas and store differ).
"""

from __future__ import annotations

import pytest

from .cluster_objects import EXAMPLES, MINIMAL, chart_settings, load_example, operator_objects
from .helm import NAMESPACE
from .kube_schemas import KUBE_VERSIONS, validation_errors
from .value_sets import VALUE_SETS


@pytest.fixture(scope="module", params=["defaults", "external-etcd"])
def settings(request, helm):
    return chart_settings(helm.template(VALUE_SETS[request.param]), NAMESPACE)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_operator_objects_are_valid(settings, example, version):
    objects = operator_objects(load_example(example), settings)
    assert {o["kind"] for o in objects} == {"ConfigMap", "Secret", "Service", "Deployment",
                                            "PodDisruptionBudget", "PDInstance", "PDPool", "Pod"}
    for obj in objects:
        assert validation_errors(obj, version) == [], f"{obj['kind']} {obj['metadata']['name']}"


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_engine_pods_with_a_model_image_need_image_volumes(settings, version):
    """``spec.model.image`` mounts an image volume: Kubernetes 1.31 and later (behind a
    feature gate until it is on by default), so 1.29 refuses the Pod."""
    cluster = load_example(MINIMAL, model={"image": "registry.example/weights:1"})
    pods = [o for o in operator_objects(cluster, settings) if o["kind"] == "Pod"]
    assert pods
    errors = [e for p in pods for e in validation_errors(p, version)]
    assert bool(errors) == (version == "1.29"), errors
