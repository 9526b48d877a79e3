"""Every example under examples/ against the generated CRD and the models.

Valid examples: admitted by the CRD schema (defaults, OpenAPI, CEL), loaded by
``PDCluster.from_file``, and naming a model the engine's loader accepts: a preset,
a local checkpoint, or (pvc, image: weights this machine does not have) the
published ``config.json`` of the checkpoint, recorded under model_configs/ by the
name the example mounts it under. Invalid ones (examples/invalid/, each naming the
field in an ``# expect-error:`` line): rejected by both, naming that field.
"""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import pytest
import yaml

from pdserve.api import PDCluster
from pdserve.api.cluster import Transport
from pdserve.api.crd import build_crd
from pdserve.api.manifest import ManifestError, load_manifest

from .apiserver import admit

ROOT = Path(__file__).resolve().parents[3]
VALID = sorted((ROOT / "examples").glob("*.yaml"))
# vLLM loads its model itself (tests/integration/test_vllm_backend.py runs that example)
EMBEDDED = [p for p in VALID if "backend: vllm" not in p.read_text()]
RECORDED = Path(__file__).resolve().parent / "model_configs"
INVALID = sorted((ROOT / "examples" / "invalid").glob("*.yaml"))


@pytest.fixture(scope="module")
def cluster_schema() -> dict:
    return build_crd("PDCluster")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def expected_field(path: Path) -> str:
    match = re.search(r"^# expect-error: (\S+)$", path.read_text(), re.MULTILINE)
    assert match, f"{path.name} needs an '# expect-error: <field>' line"
    return match.group(1)


def test_examples_exist():
    assert {p.name for p in VALID} >= {"minimal.yaml", "production.yaml"}
    assert len(INVALID) >= 3


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_example_is_admitted_by_the_crd(path, cluster_schema):
    raw = yaml.safe_load(path.read_text())
    stored, errors = admit(cluster_schema, raw)
    assert errors == []
    # The CRD's defaults are the models' defaults: defaulting changes nothing.
    assert PDCluster.model_validate(stored) == PDCluster.model_validate(raw)


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_example_loads_through_the_models(path):
    cluster = PDCluster.from_file(path)
    assert cluster.kind == "PDCluster"
    spec = cluster.spec
    assert spec.prefill.replicas + spec.decode.replicas + spec.hybrid.replicas > 0


def engine_model_config(model):
    """The engine's ``ModelConfig`` for a spec's model, as the engine would load it
    (raises ``ConfigError`` for a model it refuses)."""
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.loader import model_config
    from pdserve.runtime.model_source import PRESETS

    if model.preset is not None:  # a random preset, or a packaged file (installed on demand)
        assert model.preset in PRESETS, f"unknown preset {model.preset!r}; presets: {', '.join(PRESETS)}"
        return model_config(model.preset)
    if model.path is not None and Path(model.path).is_dir():
        return ModelConfig.from_path(Path(model.path))
    name = model.pvc.sub_path if model.pvc else (model.image or model.path)
    recorded = RECORDED / name
    assert (recorded / "config.json").is_file(), (
        f"record the published config.json of {name!r} under {recorded} to check it offline")
    return ModelConfig.from_path(recorded)


def engine_command_lines(cluster) -> dict[str, list[list[str]]]:
    """Pool -> the engine flags its engines start with, for each pool with replicas: as
    ``pdserve up`` runs them, and as the operator's Pods do (its ``--engine-arg`` flags
    last, as the NodeAgent appends them)."""
    from pdserve.nodeagent.engine_args import ENGINE_ENTRY, build_engine_argv
    from pdserve.operator.pods import agent_args

    out = {}
    for pool in ("prefill", "decode", "hybrid"):
        if getattr(cluster.spec, pool).replicas:
            extra = [a.removeprefix("--engine-arg=") for a in agent_args(cluster, "i", pool)
                     if a.startswith("--engine-arg=")]
            out[pool] = [build_engine_argv(cluster, pool)[len(ENGINE_ENTRY):],
                         build_engine_argv(cluster, pool, extra)[len(ENGINE_ENTRY):]]
    return out


def check_engine_would_start(cluster) -> None:
    """Every engine of ``cluster`` through the checks the engine runs at start, before
    it reads a weight (``pdserve engine``'s flags, dtype ``auto`` resolved, ``EngineConfig.validate``, the model's
    ``ModelConfig`` and ``EngineConfig.check_model``); raises ``ConfigError`` as it would."""
    import argparse

    from pdserve.engine import cli_serve
    from pdserve.engine.cli_args import engine_config_from_args
    from pdserve.runtime.model_source import AUTO, auto_dtype

    model = engine_model_config(cluster.spec.model)
    parser = argparse.ArgumentParser()
    cli_serve.add_arguments(parser)
    for argvs in engine_command_lines(cluster).values():
        for argv in argvs:
            config = engine_config_from_args(parser.parse_args(argv))
            if config.dtype == AUTO:  # as the engine resolves it first
                config.dtype = auto_dtype(config.model)[0]
            config.validate()
            config.check_model(model)


@pytest.mark.parametrize("path", EMBEDDED, ids=lambda p: p.name)
def test_valid_example_names_what_the_engine_runs(path):
    cluster = PDCluster.from_file(path)
    check_engine_would_start(cluster)
    spec, config = cluster.spec, engine_model_config(cluster.spec.model)
    if spec.engine.max_model_len:
        assert spec.engine.max_model_len <= config.max_position_embeddings


def test_an_example_the_engine_would_refuse_fails_the_check():
    """The spec admits these; the engine refuses them at start, and so does the check."""
    from pdserve.engine.config import ConfigError

    raw = yaml.safe_load((ROOT / "examples" / "production.yaml").read_text())
    check_engine_would_start(PDCluster.model_validate(raw))
    raw["spec"]["hybrid"]["parallelism"]["tensorParallelSize"] = 3  # 28 heads, 4 KV heads
    raw["spec"]["hybrid"]["gpus"] = 3
    with pytest.raises(ConfigError, match="num_attention_heads \\(28\\).*tensor_parallel_size \\(3\\)"):
        check_engine_would_start(PDCluster.model_validate(raw))
    raw["spec"]["hybrid"]["parallelism"]["tensorParallelSize"] = 8  # 28 heads: 8 does not divide
    raw["spec"]["hybrid"]["gpus"] = 8
    with pytest.raises(ConfigError, match="tensor_parallel_size \\(8\\)"):
        check_engine_would_start(PDCluster.model_validate(raw))


def test_the_operator_never_starts_a_gpu_engine_on_a_host_memory_transport():
    """A hybrid pool on GPUs runs without a KV transport (the engine refuses every
    transport of the spec with a KV cache on the device); GPUs in the prefill or decode pools are
    refused by the spec, naming the field."""
    raw = yaml.safe_load((ROOT / "examples" / "production.yaml").read_text())
    for transport in typing.get_args(Transport):
        raw["spec"]["kvTransfer"] = {"transport": transport}
        cluster = PDCluster.model_validate(raw)
        [local, pod] = engine_command_lines(cluster)["hybrid"]
        assert "--device=cuda" in pod and pod[pod.index("--kv-transport") + 1] == "none"
        for argv in (local, pod):  # the pool's parallelism reaches the engine
            assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
        check_engine_would_start(cluster)
    raw["spec"]["hybrid"]["gpus"] = 1  # below its 2 ranks
    with pytest.raises(ValueError, match="gpus must be 0 or at least parallelism.tensorParallelSize"):
        PDCluster.model_validate(raw)
    raw["spec"]["hybrid"]["gpus"] = 2
    raw["spec"]["decode"] = {"replicas": 1, "gpus": 1}
    with pytest.raises(ValueError, match="spec.decode.gpus must be 0"):
        PDCluster.model_validate(raw)


def test_a_refused_checkpoint_fails_the_model_check(tmp_path):
    """A RoPE scaling type the engine does not implement (Phi-3's longrope) is refused."""
    from pdserve.api.cluster import ModelSpec
    from pdserve.engine.config import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 64,
                         "long_factor": [4.0] * 64, "original_max_position_embeddings": 4096}}))
    with pytest.raises(ConfigError, match="rope_scaling"):
        engine_model_config(ModelSpec(path=str(tmp_path)))


def test_benchmark_pair_runs_at_once_on_equal_resources():
    pd = PDCluster.from_file(ROOT / "examples" / "bench-pd.yaml")
    colocated = PDCluster.from_file(ROOT / "examples" / "bench-colocated.yaml")
    assert pd.metadata.name != colocated.metadata.name  # both can run at once
    assert pd.spec.model == colocated.spec.model and pd.spec.engine == colocated.spec.engine
    pd_pools = [pd.spec.prefill, pd.spec.decode]
    assert [p.replicas for p in pd_pools] == [1, 1] and pd.spec.hybrid.replicas == 0
    assert (colocated.spec.prefill.replicas, colocated.spec.decode.replicas) == (0, 0)
    assert colocated.spec.hybrid.replicas == sum(p.replicas for p in pd_pools)
    pd_cores = [p.cpus_for_replica(0) for p in pd_pools]
    colocated_cores = [colocated.spec.hybrid.cpus_for_replica(i) for i in range(2)]
    assert pd_cores == colocated_cores == [[0], [1]]
    assert {p.threads for p in pd_pools} == {colocated.spec.hybrid.threads} == {1}


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_example_is_rejected_by_the_crd(path, cluster_schema):
    _, errors = admit(cluster_schema, yaml.safe_load(path.read_text()))
    assert errors, f"{path.name} was admitted"
    assert any(e.startswith(expected_field(path)) for e in errors), errors


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_example_is_rejected_by_the_models(path):
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert str(path) in str(info.value)
    assert any(p.startswith(expected_field(path)) for p in info.value.problems), info.value
