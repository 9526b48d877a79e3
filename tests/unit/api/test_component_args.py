"""The spec as the Coordinator's command line: one function, used by `pdserve up` and the operator."""

from __future__ import annotations

import argparse

import pytest

from pdserve.api import ManifestError, parse_manifest
from pdserve.api.component_args import coordinator_argv, model_location
from pdserve.coordinator.cli import add_arguments, settings_from_args
from pdserve.coordinator.settings import CoordinatorSettings


def cluster(**spec):
    base = {"model": {"preset": "tiny"}}
    return parse_manifest({"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                           "metadata": {"name": "c", "namespace": "ns"}, "spec": {**base, **spec}})


def parsed(argv: list[str]) -> argparse.Namespace:
    assert argv[0] == "coordinator"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv[1:])


def test_every_coordinator_setting_of_the_spec_is_on_the_command_line():
    c = cluster(model={"preset": "small", "servedName": "mymodel"},
                routing={"prefillPolicy": "round_robin", "decodePolicy": "slo_aware",
                         "localPrefillMaxTokens": 32, "loadAwareLocalPrefill": False},
                kvTransfer={"mode": "pull", "decodeAllocation": "prefill_complete"},
                fallback={"policy": "queue"}, engine={"blockSize": 32},
                slo={"ttftMs": 750, "tpotMs": 40},
                timeouts={"firstTokenSeconds": 20, "tokenIdleSeconds": 5.5, "requestSeconds": 600})
    args = parsed(coordinator_argv(c, "10.0.0.1", 8123, "ctl:50050"))
    assert (args.host, args.port, args.controller) == ("10.0.0.1", 8123, "ctl:50050")
    settings = settings_from_args(args)
    assert settings.model == "small" and settings.model_name == "mymodel"
    assert (settings.prefill_policy, settings.decode_policy) == ("round_robin", "slo_aware")
    assert settings.local_prefill_max_tokens == 32 and settings.kv_mode == "pull"
    assert settings.load_aware_local_prefill is False
    assert settings.fallback_policy == "queue" and settings.block_size == 32
    assert settings.ttft_slo_s == 0.75 and settings.tpot_slo_s == 0.04
    assert (settings.first_token_timeout_s, settings.token_idle_timeout_s) == (20, 5.5)
    assert settings.request_timeout_s == 600


def test_defaults_serve_the_cluster_name_and_omit_the_slo_and_the_total():
    argv = coordinator_argv(cluster(), "127.0.0.1", 8000, "127.0.0.1:1")
    assert "--ttft-slo-s" not in argv and "--tpot-slo-s" not in argv
    assert "--request-timeout-s" not in argv
    args = parsed(argv)
    assert args.served_model_name == "c" and args.model == "tiny"
    assert args.load_aware_local_prefill is True
    settings = settings_from_args(args)
    defaults = CoordinatorSettings()  # the spec's defaults are the Coordinator's
    assert (settings.first_token_timeout_s, settings.token_idle_timeout_s,
            settings.request_timeout_s) == (defaults.first_token_timeout_s,
                                            defaults.token_idle_timeout_s, None)


def test_a_timeout_is_a_positive_number_of_seconds():
    for bad in ({"tokenIdleSeconds": 0}, {"firstTokenSeconds": -1}, {"requestSeconds": 0}):
        with pytest.raises(ManifestError) as info:
            cluster(timeouts=bad)
        assert f"spec.timeouts.{next(iter(bad))}" in info.value.explain()


def test_pure_same_inputs_same_argv():
    c = cluster(slo={"ttftMs": 500})
    assert coordinator_argv(c, "h", 1, "x:2") == coordinator_argv(c, "h", 1, "x:2")


def test_mounted_model_sources_resolve_to_the_mount_path():
    assert model_location(cluster(model={"pvc": {"claimName": "w", "subPath": "llama"}}).spec) == "/models/llama"
    assert model_location(cluster(model={"image": "reg/weights:1"}).spec) == "/models/"
    assert model_location(cluster(model={"path": "/ckpt"}).spec) == "/ckpt"
