"""Each setting reaches the Pods that consume it, and no other: a Coordinator- or
Controller-only change leaves every engine Pod as it is (no outage), an engine
setting changes the engine Pods (of its pool only, when it is a pool's), and what an
engine Pod runs from its own cluster file is what the whole spec says."""

from __future__ import annotations

import pytest

from pdserve.api.manifest import load_manifest
from pdserve.nodeagent.engine_args import build_engine_argv
from pdserve.operator import builders as b
from pdserve.operator.deployments import build_controller_deployment, build_coordinator_deployment
from pdserve.operator.desired import build_static_objects
from pdserve.operator.pods import build_engine_config_map, build_engine_pod
from pdserve.operator.settings import OperatorSettings
from tests.unit.chart.cluster_objects import EXAMPLES, load_example
from tests.unit.operator.test_builders import cluster, engine_hashes

SETTINGS = OperatorSettings()


def engine_pods(c) -> dict[str, dict]:
    return {name: build_engine_pod(c, name, pool, "u", SETTINGS)
            for name, (pool, _) in b.desired_instances(c).items()}


def template(deployment: dict) -> dict:
    return deployment["spec"]["template"]


COORDINATOR_ONLY = [
    {"routing": {"prefillPolicy": "round_robin", "decodePolicy": "slo_aware"}},
    {"routing": {"localPrefillMaxTokens": 0, "loadAwareLocalPrefill": False}},
    {"slo": {"ttftMs": 400, "tpotMs": 40}},
    {"model": {"preset": "tiny", "servedName": "chat"}},
    {"security": {"apiKeySecret": {"name": "keys", "key": "coordinator"}}},
    {"coordinator": {"replicas": 3, "resources": {"requests": {"cpu": "2"}}}},
]
CONTROLLER_ONLY = [
    {"fallback": {"hysteresisSeconds": 5}},
    {"heartbeat": {"suspectAfterMissed": 5, "failedAfterMissed": 20}},
    {"controller": {"replicas": 2, "resources": {"requests": {"cpu": "1"}}}},
    {"planner": {"enabled": True}},
]


BOTH = [{"fallback": {"policy": "fail"}}]  # the Controller's mode and the Coordinator's routing


@pytest.mark.parametrize("change", COORDINATOR_ONLY + CONTROLLER_ONLY + BOTH, ids=lambda c: next(iter(c)))
def test_control_plane_settings_leave_every_engine_pod_alone(change):
    before, after = cluster(), cluster(**change)
    assert engine_pods(after) == engine_pods(before)
    assert engine_hashes(after) == engine_hashes(before)
    engine_files = [o for o in build_static_objects(before, SETTINGS)
                    if o["metadata"]["labels"][b.COMPONENT_LABEL] == "engine-config"]
    assert engine_files == [o for o in build_static_objects(after, SETTINGS)
                            if o["metadata"]["labels"][b.COMPONENT_LABEL] == "engine-config"]


@pytest.mark.parametrize("change", COORDINATOR_ONLY, ids=lambda c: next(iter(c)))
def test_coordinator_settings_roll_the_coordinator_only(change):
    before, after = cluster(), cluster(**change)
    assert template(build_controller_deployment(after, SETTINGS)) == template(
        build_controller_deployment(before, SETTINGS))
    if next(iter(change)) != "coordinator" or "resources" in change["coordinator"]:
        assert template(build_coordinator_deployment(after, SETTINGS)) != template(
            build_coordinator_deployment(before, SETTINGS))


@pytest.mark.parametrize("change", CONTROLLER_ONLY, ids=lambda c: next(iter(c)))
def test_controller_settings_roll_the_controller_only(change):
    before, after = cluster(), cluster(**change)
    assert template(build_coordinator_deployment(after, SETTINGS)) == template(
        build_coordinator_deployment(before, SETTINGS))
    assert template(build_controller_deployment(after, SETTINGS)) != template(
        build_controller_deployment(before, SETTINGS))


@pytest.mark.parametrize("change", BOTH, ids=lambda c: next(iter(c)))
def test_the_fallback_policy_rolls_both(change):
    before, after = cluster(), cluster(**change)
    for build in (build_coordinator_deployment, build_controller_deployment):
        assert template(build(after, SETTINGS)) != template(build(before, SETTINGS))


def test_scaling_rolls_nothing_but_a_pool_appearing_reaches_the_controller():
    base = cluster()
    for change in ({"prefill": {"replicas": 5}}, {"decode": {"replicas": 3}},
                   {"coordinator": {"replicas": 4}}):
        assert template(build_coordinator_deployment(cluster(**change), SETTINGS)) == template(
            build_coordinator_deployment(base, SETTINGS))
        assert template(build_controller_deployment(cluster(**change), SETTINGS)) == template(
            build_controller_deployment(base, SETTINGS))
    # the Controller decides fallback by which pools exist
    assert template(build_controller_deployment(cluster(hybrid={"replicas": 1}), SETTINGS)) != template(
        build_controller_deployment(base, SETTINGS))


def test_with_the_planner_on_its_settings_and_the_slo_roll_the_controller_but_scaling_does_not():
    on = {"planner": {"enabled": True, "intervalSeconds": 1}}
    base = build_controller_deployment(cluster(**on), SETTINGS)
    for change in ({"planner": {**on["planner"], "cooldownSeconds": 5}}, {"slo": {"ttftMs": 400}}):
        assert template(build_controller_deployment(cluster(**{**on, **change}), SETTINGS)) != template(base)
    for change in ({"prefill": {"replicas": 5}}, {"decode": {"replicas": 3}}):
        assert template(build_controller_deployment(cluster(**{**on, **change}), SETTINGS)) == template(base)


@pytest.mark.parametrize(("change", "pools"), [
    ({"engine": {"maxNumSeqs": 8}}, {"prefill", "decode", "hybrid"}),
    ({"kvTransfer": {"transport": "shm"}}, {"prefill", "decode", "hybrid"}),
    ({"heartbeat": {"intervalSeconds": 2}}, {"prefill", "decode", "hybrid"}),  # the agents send them
    ({"model": {"pvc": {"claimName": "w"}}}, {"prefill", "decode", "hybrid"}),
    ({"image": "pdserve:2"}, {"prefill", "decode", "hybrid"}),
    ({"prefill": {"replicas": 2, "threads": 4}}, {"prefill"}),
    ({"hybrid": {"replicas": 1, "gpus": 1}}, {"hybrid"}),
    ({"decode": {"replicas": 1, "antiAffinity": "preferred"}}, {"decode"}),
    ({"security": {"tlsSecret": "certs"}}, {"prefill", "decode", "hybrid"}),
])
def test_engine_settings_change_the_engine_pods_of_their_pools(change, pools):
    before, after = engine_hashes(cluster()), engine_hashes(cluster(**change))
    assert {p for p in before if before[p] != after[p]} == pools


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_an_engine_pod_runs_what_the_whole_spec_says(tmp_path, example):
    """The agent reads its pool's engine file, not the whole spec: both give the same
    engine command line and heartbeat interval."""
    c = load_example(example)
    for pool in b.POOLS:
        (tmp_path / "cluster.yaml").write_text(build_engine_config_map(c, pool)["data"]["cluster.yaml"])
        seen = load_manifest(tmp_path / "cluster.yaml")
        assert build_engine_argv(seen, pool) == build_engine_argv(c, pool)
        assert seen.spec.heartbeat.interval_seconds == c.spec.heartbeat.interval_seconds
        assert seen.metadata.name == c.metadata.name


def test_engine_files_are_immutable_and_named_by_their_content():
    c = cluster(prefill={"replicas": 1, "threads": 2})
    first = build_engine_config_map(c, "prefill")
    assert first["immutable"] is True
    assert build_engine_config_map(cluster(prefill={"replicas": 4, "threads": 2}), "prefill") == first
    assert build_engine_config_map(cluster(prefill={"replicas": 1, "threads": 3}), "prefill")[
        "metadata"]["name"] != first["metadata"]["name"]
