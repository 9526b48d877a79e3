"""Every object the chart renders, for every value set, is one a Kubernetes apiserver of
each supported version takes (kube_schemas.py: the versions' OpenAPI schemas, strict;
custom resources against the chart's CRDs), and the checker itself refuses bad ones."""

from __future__ import annotations

import pytest

from .kube_schemas import KUBE_VERSIONS, UNCHECKED, validation_errors
from .value_sets import VALUE_SETS


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", VALUE_SETS)
def test_chart_objects_are_valid(helm, name, version):
    for obj in helm.template(VALUE_SETS[name]).objects:
        assert validation_errors(obj, version) == [], f"{obj['kind']} {obj['metadata']['name']}"


def test_only_the_service_monitor_goes_unchecked(helm):
    kinds = {(o["apiVersion"], o["kind"]) for v in VALUE_SETS.values() for o in helm.template(v).objects}
    assert kinds & UNCHECKED == {("monitoring.coreos.com/v1", "ServiceMonitor")}


def pod(**container) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c", "image": "i", **container}]}}


def instance(**spec) -> dict:
    return {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDInstance",
            "metadata": {"name": "c-decode-0", "labels": {"a": "b"}},
            "spec": {"role": "decode", "cluster": "c", "pool": "decode", "ordinal": 0, **spec}}


def test_the_checker_refuses_what_an_apiserver_refuses():
    assert validation_errors(pod(), "1.33") == []
    assert validation_errors(pod(bogus=1), "1.33") == [
        "spec.containers.0: Additional properties are not allowed ('bogus' was unexpected)"]
    assert validation_errors(pod(ports=[{"containerPort": "80"}]), "1.33") == [
        "spec.containers.0.ports.0.containerPort: '80' is not of type 'integer'"]
    image_volume = pod()
    image_volume["spec"]["volumes"] = [{"name": "m", "image": {"reference": "r"}}]
    assert validation_errors(image_volume, "1.33") == []
    assert validation_errors(image_volume, "1.29")  # image volumes came in 1.31
    assert validation_errors({**pod(), "kind": "Podd"}, "1.33")  # no schema is an error
    assert validation_errors(instance(), "1.33") == []
    assert validation_errors(instance(role="prefil"), "1.33")
    assert validation_errors(instance(replica=1), "1.33") == ["spec.replica: not in the schema (pruned)"]
    assert validation_errors({**instance(), "metadata": {"name": "x", "labels": {"a": 1}}}, "1.33")
