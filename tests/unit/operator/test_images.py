"""Three images: the control plane (no torch) runs a cluster's Controller and
Coordinator, the engine image its engine Pods and KV pool master, the vLLM engine image
(vLLM's with pdserve added) the engine Pods of a ``backend: vllm`` cluster;
``spec.image`` replaces all three. An older chart's single ``PDSERVE_CLUSTER_IMAGE``
still runs everything, and one without ``PDSERVE_VLLM_ENGINE_IMAGE`` runs vLLM engines
on the engine image as before."""

from __future__ import annotations

from pdserve.operator.pods import build_engine_pod, engine_image_for, engine_pod_hash
from pdserve.operator.settings import (
    DEFAULT_ENGINE_IMAGE,
    DEFAULT_IMAGE,
    DEFAULT_VLLM_ENGINE_IMAGE,
    OperatorSettings,
)
from tests.unit.operator.test_builders import cluster

SETTINGS = OperatorSettings(image="cp:1", engine_image="engine:1", vllm_engine_image="vllm:1")


def images(env: dict) -> tuple[str, str, str]:
    s = OperatorSettings.from_env(env)
    return s.image, s.engine_image, s.vllm_engine_image


def vllm_cluster(**spec):
    return cluster(model={"pvc": {"claimName": "weights", "subPath": "qwen"}},
                   engine={"backend": "vllm"}, kvTransfer={"mode": "pull", "transport": "nixl"},
                   prefill={"replicas": 1}, decode={"replicas": 1}, **spec)


def pod_image(c, settings: OperatorSettings = SETTINGS) -> str:
    return build_engine_pod(c, "c-decode-0", "decode", "u", settings)["spec"]["containers"][0]["image"]


def test_each_image_from_its_variable():
    assert images({}) == (DEFAULT_IMAGE, DEFAULT_ENGINE_IMAGE, DEFAULT_VLLM_ENGINE_IMAGE)
    assert images({"PDSERVE_CLUSTER_IMAGE": "cp:1", "PDSERVE_ENGINE_IMAGE": "engine:1",
                   "PDSERVE_VLLM_ENGINE_IMAGE": "vllm:1"}) == ("cp:1", "engine:1", "vllm:1")
    assert images({"PDSERVE_VLLM_ENGINE_IMAGE": "vllm:1"}) == \
        (DEFAULT_IMAGE, DEFAULT_ENGINE_IMAGE, "vllm:1")


def test_an_older_charts_images_run_the_engines_as_they_did():
    assert images({"PDSERVE_CLUSTER_IMAGE": "all:1"}) == ("all:1", "all:1", "all:1")
    assert images({"PDSERVE_CLUSTER_IMAGE": "all:1", "PDSERVE_ENGINE_IMAGE": ""}) == \
        ("all:1", "all:1", "all:1")
    assert images({"PDSERVE_CLUSTER_IMAGE": "cp:1", "PDSERVE_ENGINE_IMAGE": "engine:1"}) == \
        ("cp:1", "engine:1", "engine:1")


def test_a_vllm_clusters_engines_run_the_vllm_engine_image_and_spec_image_beats_both():
    embedded, vllm = cluster(), vllm_cluster()
    assert (pod_image(embedded), pod_image(vllm)) == ("engine:1", "vllm:1")
    assert engine_image_for(vllm, SETTINGS) == "vllm:1"
    assert pod_image(cluster(image="mine:2")) == pod_image(vllm_cluster(image="mine:2")) == "mine:2"


def test_the_pod_hash_follows_the_image_of_the_clusters_backend():
    """A new vLLM engine image rolls vLLM clusters' Pods, and only theirs."""
    newer = OperatorSettings(image="cp:1", engine_image="engine:1", vllm_engine_image="vllm:2")
    assert engine_pod_hash(vllm_cluster(), "decode", newer) != \
        engine_pod_hash(vllm_cluster(), "decode", SETTINGS)
    assert engine_pod_hash(cluster(), "decode", newer) == engine_pod_hash(cluster(), "decode", SETTINGS)
    mine = vllm_cluster(image="mine:2")
    assert engine_pod_hash(mine, "decode", newer) == engine_pod_hash(mine, "decode", SETTINGS)
