"""The chart's ServiceMonitor finds what is to be scraped: the release's operator and the
Services the operator builds for a PDCluster (examples/minimal.yaml, in a namespace the
operator watches), matched as the Prometheus Operator matches them: label selector,
namespace selector, endpoint port names."""

from __future__ import annotations

import pytest

from .cluster_objects import MINIMAL, chart_settings, load_example, operator_objects
from .helm import NAMESPACE
from .value_sets import VALUE_SETS

# (Service, port name) of every /metrics endpoint, for release "r" and cluster "tiny"
METRICS = {("tiny-coordinator", "http"), ("tiny-controller", "http"), ("tiny-engines", "http"),
           ("tiny-engines", "metrics")}


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions)."""
    tests = {"In": lambda e: labels.get(e["key"]) in e["values"],
             "NotIn": lambda e: labels.get(e["key"]) not in e["values"],
             "Exists": lambda e: e["key"] in labels,
             "DoesNotExist": lambda e: e["key"] not in labels}
    return (all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
            and all(tests[e["operator"]](e) for e in selector.get("matchExpressions", [])))


def in_namespaces(namespace_selector: dict, namespace: str, own_namespace: str) -> bool:
    """The Prometheus Operator's: ``any``, ``matchNames``, or (neither) its own namespace."""
    if namespace_selector.get("any"):
        return True
    return namespace in namespace_selector.get("matchNames", [own_namespace])


def scraped(monitor: dict, services: list[dict]) -> set[tuple[str, str]]:
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    return {(s["metadata"]["name"], p["name"]) for s in services
            if selects(monitor["spec"]["selector"], s["metadata"]["labels"])
            and in_namespaces(monitor["spec"]["namespaceSelector"], s["metadata"]["namespace"],
                              monitor["metadata"]["namespace"])
            for p in s["spec"]["ports"] if p["name"] in ports}


@pytest.mark.parametrize("name", ["monitoring", "namespaced", "names"])
def test_service_monitor_scrapes_the_operator_and_every_cluster_service(helm, name):
    values = VALUE_SETS[name]
    rendered = helm.template(values)
    [monitor] = rendered.of_kind("ServiceMonitor")
    watched = values.get("operator", {}).get("watchNamespace")
    cluster = load_example(MINIMAL, watched or "default")
    built = [o for o in operator_objects(cluster, chart_settings(rendered, NAMESPACE))
             if o["kind"] == "Service"]
    [operator] = [s["metadata"]["name"] for s in rendered.of_kind("Service")
                  if s["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"]
    assert scraped(monitor, rendered.of_kind("Service") + built) == {*METRICS, (operator, "metrics")}
    if watched:  # no namespace beyond the watched one and the release's
        assert scraped(monitor, [{**s, "metadata": {**s["metadata"], "namespace": "elsewhere"}}
                                 for s in built]) == set()


def test_service_monitor_endpoints_interval_and_labels(helm):
    values = VALUE_SETS["monitoring"]["metrics"]["serviceMonitor"]
    [monitor] = helm.template(VALUE_SETS["monitoring"]).of_kind("ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [
        {"port": port, "path": "/metrics", "interval": values["interval"]} for port in ("metrics", "http")]
    assert helm.template().of_kind("ServiceMonitor") == []
