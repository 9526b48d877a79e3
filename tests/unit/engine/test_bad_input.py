"""Bad requests and bad checkpoints are refused with a message that names the problem.

Requests are refused in ``add_request`` with ``EngineInputError`` and never reach the
step loop, so the engine keeps serving; checkpoints and settings that pdserve cannot
serve fail at start-up with ``ConfigError``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pdserve.api.sampling import SamplingParams
from pdserve.engine.admission import EngineInputError
from pdserve.engine.config import ConfigError, EngineConfig
from pdserve.engine.llm_engine import LLMEngine

GOOD_PROMPT = [10, 20, 30, 40, 50]


@pytest.fixture
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", block_size=8, num_kv_blocks=16, max_model_len=64))


def serves_a_good_request(engine: LLMEngine) -> None:
    """After refusals the engine still serves, with the output of a fresh engine."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    [out] = engine.generate([GOOD_PROMPT], params)
    fresh = LLMEngine(EngineConfig(model="tiny", block_size=8, num_kv_blocks=16))
    assert out == fresh.generate([GOOD_PROMPT], params)[0]
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.requests and not engine.has_unfinished


# -- requests -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "the prompt is empty"),
        ([1] * 64, "prompt has 64 tokens; this engine's limit is 63"),
        ([1, 2, 320], "prompt token ids must be in [0, 320)"),
        ([1, -1], "prompt token ids must be in [0, 320)"),
        ([1, 2.5], "prompt token ids must be integers"),
        ([1, "2"], "prompt token ids must be integers"),
    ],
    ids=["empty", "too-long", "past-vocab", "negative", "float", "str"],
)
def test_bad_prompt_is_refused(engine, prompt, message):
    with pytest.raises(EngineInputError) as exc:
        engine.add_request("bad", prompt)
    assert message in str(exc.value)
    assert "bad" not in engine.requests
    serves_a_good_request(engine)


def test_prompt_longer_than_the_kv_cache_is_refused():
    engine = LLMEngine(EngineConfig(model="tiny", block_size=8, num_kv_blocks=4))
    with pytest.raises(EngineInputError, match=r"KV capacity 32 tokens"):
        engine.add_request("bad", [1] * 40)
    serves_a_good_request(engine)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(max_tokens=-1), "max_tokens must be a positive integer"),
        (SamplingParams(max_tokens=0), "max_tokens must be a positive integer"),
        (SamplingParams(temperature=-0.5), "temperature must be in [0, 100]"),
        (SamplingParams(top_p=0.0), "top_p must be in (0, 1]"),
        (SamplingParams(top_p=1.5), "top_p must be in (0, 1]"),
        (SamplingParams(top_k=-1), "top_k must be >= 0"),
        (SamplingParams(seed=-3), "seed must be in"),
        (SamplingParams(stop=[""]), "stop strings must be non-empty"),
        (SamplingParams(stop_token_ids=[999]), "stop_token_ids out of vocabulary range"),
    ],
    ids=["max_tokens<0", "max_tokens=0", "temperature<0", "top_p=0", "top_p>1", "top_k<0",
         "seed<0", "empty-stop", "stop-id"],
)
def test_bad_sampling_values_are_refused(engine, params, message):
    with pytest.raises(EngineInputError) as exc:
        engine.add_request("bad", GOOD_PROMPT, params)
    assert message in str(exc.value)
    serves_a_good_request(engine)


def test_duplicate_request_id_is_refused(engine):
    first = engine.add_request("same", GOOD_PROMPT, SamplingParams(max_tokens=3))
    with pytest.raises(EngineInputError, match="request id 'same' is already in use"):
        engine.add_request("same", GOOD_PROMPT)
    assert engine.requests["same"] is first
    while engine.has_unfinished:
        engine.step()
    assert len(first.output_token_ids) <= 3
    serves_a_good_request(engine)


def test_request_without_any_prompt_is_refused(engine):
    with pytest.raises(EngineInputError, match="the prompt is empty"):
        engine.add_request("bad")
    serves_a_good_request(engine)


# -- checkpoints ----------------------------------------------------------------------

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
}


def hf_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (64, 32),
        "model.norm.weight": (32,),
        "lm_head.weight": (64, 32),
        "model.layers.0.self_attn.q_proj.weight": (32, 32),
        "model.layers.0.self_attn.k_proj.weight": (16, 32),
        "model.layers.0.self_attn.v_proj.weight": (16, 32),
        "model.layers.0.self_attn.o_proj.weight": (32, 32),
        "model.layers.0.mlp.gate_proj.weight": (48, 32),
        "model.layers.0.mlp.up_proj.weight": (48, 32),
        "model.layers.0.mlp.down_proj.weight": (32, 48),
        "model.layers.0.input_layernorm.weight": (32,),
        "model.layers.0.post_attention_layernorm.weight": (32,),
    }
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def write_checkpoint(path: Path, config=HF_CONFIG, tensors=None) -> Path:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(hf_tensors() if tensors is None else tensors, str(path / "model.safetensors"))
    return path


def start(model: str, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, num_kv_blocks=8, **settings))


def test_checkpoint_without_tokenizer_refuses_text_prompts(tmp_path):
    engine = start(str(write_checkpoint(tmp_path / "ckpt")))
    assert engine.tokenizer is None
    with pytest.raises(EngineInputError, match="no tokenizer: send prompt token ids"):
        engine.add_request("text", prompt="hello")
    [out] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out) == 4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_unknown_preset_or_missing_dir(tmp_path):
    with pytest.raises(ConfigError, match=r"'huge' is neither a preset \(tiny, small, smollm2\), a directory nor a \.gguf file"):
        start("huge")
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match="neither a preset") as exc:
        start(str(missing))
    assert str(missing) in str(exc.value)


def test_dir_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        start(str(tmp_path))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        (json.dumps({**HF_CONFIG, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}),
         "unsupported architecture ['GPT2LMHeadModel']"),
        (json.dumps({k: v for k, v in HF_CONFIG.items() if k != "hidden_size"}),
         "config.json lacks required field 'hidden_size'"),
        (json.dumps({**HF_CONFIG, "num_key_value_heads": 3}),
         "must be a multiple of num_key_value_heads (3)"),
    ],
    ids=["not-json", "not-object", "architecture", "missing-field", "heads"],
)
def test_malformed_config_json(tmp_path, text, message):
    write_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError) as exc:
        start(str(tmp_path))
    assert message in str(exc.value)


def test_missing_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    with pytest.raises(ConfigError, match=r"has no \*.safetensors weights"):
        start(str(tmp_path))
    tensors = hf_tensors()
    del tensors["model.layers.0.mlp.down_proj.weight"]
    write_checkpoint(tmp_path, tensors=tensors)
    with pytest.raises(ConfigError, match="checkpoint lacks weights for: layers.0.mlp.down_weight"):
        start(str(tmp_path))


def test_wrong_tensor_shape(tmp_path):
    tensors = hf_tensors()
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    write_checkpoint(tmp_path, tensors=tensors)
    with pytest.raises(ConfigError) as exc:
        start(str(tmp_path))
    assert str(exc.value) == (
        "tensor model.layers.0.self_attn.k_proj.weight has shape (8, 32), expected (16, 32)"
    )


def test_unreadable_weights_file(tmp_path):
    write_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="cannot read model.safetensors"):
        start(str(tmp_path))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(block_size=12), "block_size must be a power of two"),
        (dict(dtype="int8"), "dtype must be one of"),
        (dict(role="both"), "role must be one of"),
        (dict(max_num_seqs=0), "max_num_seqs must be positive"),
        (dict(num_kv_blocks=None, kv_cache_bytes=100), "kv_cache_bytes=100 is below one block"),
    ],
    ids=["block_size", "dtype", "role", "max_num_seqs", "kv-budget"],
)
def test_bad_engine_settings(settings, message):
    config = EngineConfig(model="tiny", **{"num_kv_blocks": 8, **settings})
    with pytest.raises(ConfigError) as exc:
        LLMEngine(config)
    assert message in str(exc.value)
