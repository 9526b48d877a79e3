"""Two images: the control plane (no torch) runs a cluster's Controller and Coordinator,
the engine image its engine Pods and KV pool master; ``spec.image`` replaces both. An
older chart's single ``PDSERVE_CLUSTER_IMAGE`` still runs everything."""

from __future__ import annotations

from pdserve.operator.settings import DEFAULT_ENGINE_IMAGE, DEFAULT_IMAGE, OperatorSettings


def images(env: dict) -> tuple[str, str]:
    s = OperatorSettings.from_env(env)
    return s.image, s.engine_image


def test_each_image_from_its_variable():
    assert images({}) == (DEFAULT_IMAGE, DEFAULT_ENGINE_IMAGE)
    assert images({"PDSERVE_CLUSTER_IMAGE": "cp:1", "PDSERVE_ENGINE_IMAGE": "engine:1"}) == \
        ("cp:1", "engine:1")
    assert images({"PDSERVE_ENGINE_IMAGE": "engine:1"}) == (DEFAULT_IMAGE, "engine:1")


def test_an_older_charts_one_image_runs_the_engines_too():
    assert images({"PDSERVE_CLUSTER_IMAGE": "all:1"}) == ("all:1", "all:1")
    assert images({"PDSERVE_CLUSTER_IMAGE": "all:1", "PDSERVE_ENGINE_IMAGE": ""}) == ("all:1", "all:1")
