"""dtype ``auto`` (the default): an engine serves a checkpoint in the checkpoint's own
dtype, a GGUF file and the random presets in float32; the Coordinator, the doctor and
``pdserve up`` resolve ``auto`` the same way the engine does."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.api import default_cluster
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.local.up import with_overrides
from pdserve.runtime.model_source import auto_dtype, resolve_dtype
from tests.unit.engine.hf_models import build_hf_model, save_hf_model


@pytest.mark.parametrize(("config", "want"), [
    ({"dtype": "bfloat16"}, "bfloat16"),  # transformers 5 writes "dtype"
    ({"torch_dtype": "float16"}, "float16"),  # 4.x wrote "torch_dtype"
    ({}, "float32"),
    ({"dtype": "int8"}, "float32"),  # not a dtype an engine runs in
])
def test_auto_is_the_checkpoints_dtype(tmp_path, config, want):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    assert auto_dtype(str(tmp_path))[0] == want
    assert resolve_dtype(str(tmp_path), "auto") == want
    assert resolve_dtype(str(tmp_path), "float16") == "float16"  # a dtype asked for wins


def test_random_presets_and_gguf_files_are_float32(tmp_path):
    assert auto_dtype("tiny") == ("float32", "random-weight preset")
    assert auto_dtype(str(tmp_path / "model.Q4_K.gguf"))[0] == "float32"


def test_an_engine_loads_a_bfloat16_checkpoint_in_bfloat16_by_default(tmp_path):
    model = build_hf_model("llama").to(torch.bfloat16)
    save_hf_model(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()).get("dtype") == "bfloat16"
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="auto", num_kv_blocks=8))
    assert engine.config.dtype == "bfloat16"
    assert engine.runner.model.embed_tokens.dtype == torch.bfloat16


def test_up_takes_dtype_over_the_spec():
    cluster = with_overrides(default_cluster(), None, None, "bfloat16")
    assert cluster.spec.engine.dtype == "bfloat16"
    assert default_cluster().spec.engine.dtype == "auto"
