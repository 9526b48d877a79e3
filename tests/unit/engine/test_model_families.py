"""Today's model families against transformers: RoPE scaling, Qwen3, Mistral, EOS ids.

Each case saves a tiny random checkpoint (2 layers, hidden 64), loads it into an
engine and checks logits and greedy tokens against transformers on the same weights.
Prompts plus outputs run past ``original_max_position_embeddings`` (32), so a scaled
RoPE that silently ran plain would fail here.
"""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.api.sampling import SamplingParams
from pdserve.engine.config import ConfigError, EngineConfig, ModelConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import _fill_preset, load_model
from pdserve.engine.model import Transformer
from pdserve.engine.rope import inv_freq
from tests.unit.engine.hf_models import (
    build_hf_model,
    full_prefill_logits,
    hf_greedy,
    save_hf_model,
)

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)
LINEAR = dict(rope_type="linear", factor=2.0)
DYNAMIC = dict(rope_type="dynamic", factor=2.0)
PROMPTS = [[5, 17, 99, 3, 250, 42, 42, 7, 64, 128, 1, 300, 11, 23], list(range(40, 80))]
NUM_NEW = 20


def as_transformers_4_file(path, theta: float) -> None:
    """Rewrite a 5.x config.json the way transformers 4.x saved it: ``rope_scaling``
    without ``rope_theta``, and ``rope_theta`` at the top level."""
    raw = json.loads((path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    rope.pop("rope_theta")
    raw.update(rope_scaling=rope, rope_theta=theta)
    (path / "config.json").write_text(json.dumps(raw))


CASES = {  # id: (kind, rope parameters or None, write a transformers 4.x config.json)
    "llama3-rope_parameters": ("llama", LLAMA3, False),
    "llama3-rope_scaling": ("llama", LLAMA3, True),
    "yarn": ("llama", YARN, False),
    "linear": ("llama", LINEAR, True),
    "dynamic": ("llama", DYNAMIC, False),
    "qwen3": ("qwen3", None, False),
    "qwen3-yarn": ("qwen3", YARN, False),
    "mistral": ("mistral", None, False),
    # Windows of 8 under 40-token prompts and 20 new tokens: most keys fall outside.
    "mistral-sliding": ("mistral", None, False, {"sliding_window": 8}),
    "qwen2-sliding": ("qwen2", None, False, {"use_sliding_window": True, "sliding_window": 8,
                                             "max_window_layers": 1}),  # layer 1 of 0..1
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_matches_transformers(tmp_path, case):
    kind, rope, old_file, *extra = CASES[case]
    theta = 10000.0 if kind not in ("qwen2", "qwen3") else 1000000.0
    overrides = {"num_hidden_layers": 2, **(extra[0] if extra else {})}
    if rope is not None:
        overrides["rope_parameters"] = {"rope_theta": theta, **rope}
    hf = build_hf_model(kind, seed=3, **overrides)
    save_hf_model(hf, tmp_path)
    if old_file:
        as_transformers_4_file(tmp_path, theta)
    model, _ = load_model(str(tmp_path))
    scaling = model.config.rope_scaling
    assert (scaling and scaling.rope_type) == (rope and rope["rope_type"])
    theirs_freq = hf.model.rotary_emb.inv_freq
    ours_freq, ours_scale = inv_freq(model.config)
    torch.testing.assert_close(ours_freq, theirs_freq)
    assert ours_scale == pytest.approx(hf.model.rotary_emb.attention_scaling)

    ours = full_prefill_logits(model, PROMPTS[1])
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPTS[1]])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)

    engine = LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=64, block_size=4))
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=NUM_NEW))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out == hf_greedy(hf, prompt, NUM_NEW)
        assert len(set(out)) >= 3, f"degenerate reference output {out}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_scaled_rope_differs_from_plain():
    """The oracle cases above can tell a scaled table from a plain one."""
    base = dict(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=64, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                max_position_embeddings=512)
    plain, _ = inv_freq(ModelConfig(**base))
    for rope in (LLAMA3, YARN, LINEAR):
        raw = {**base, "architectures": [base["architecture"]], "rope_parameters": rope}
        scaled, _ = inv_freq(ModelConfig.from_hf_dict(raw))
        assert not torch.allclose(scaled, plain), rope


HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "max_position_embeddings": 4096}


@pytest.mark.parametrize(("field", "rope", "message"), [
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "rope_parameters type 'longrope'"),
    ("rope_scaling", {"type": "su", "factor": 2.0}, "rope_scaling type 'su'"),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0}, "needs low_freq_factor"),
    ("rope_scaling", {"rope_type": "linear"}, "needs a numeric factor"),
    ("rope_parameters", {"full_attention": {"rope_type": "default"}}, "per-layer-type"),
], ids=["5.x-unknown", "4.x-unknown", "llama3-incomplete", "linear-no-factor", "nested"])
def test_unimplemented_rope_is_refused(field, rope, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict({**HF_CONFIG, field: rope})


def test_partial_rotary_is_refused():
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        ModelConfig.from_hf_dict({**HF_CONFIG, "partial_rotary_factor": 0.5})


@pytest.mark.parametrize(("arch", "extra", "window", "layers"), [
    ("MistralForCausalLM", {"sliding_window": 1024}, 1024, (0, 1)),
    ("MistralForCausalLM", {"sliding_window": None}, None, ()),
    ("Qwen3ForCausalLM", {"sliding_window": 1024, "use_sliding_window": False}, None, ()),
    ("Qwen2ForCausalLM", {"sliding_window": 1024, "use_sliding_window": True,
                          "max_window_layers": 1}, 1024, (1,)),
    ("Qwen2ForCausalLM", {"sliding_window": 64, "use_sliding_window": True,
                          "layer_types": ["sliding_attention", "full_attention"]}, 64, (0,)),
    ("LlamaForCausalLM", {"sliding_window": 64}, None, ()),
])
def test_sliding_windows_are_read_per_layer_and_never_cap_the_positions(arch, extra, window, layers):
    cfg = ModelConfig.from_hf_dict({**HF_CONFIG, "architectures": [arch], **extra})
    assert (cfg.sliding_window, cfg.sliding_layers) == (window, layers)
    assert [cfg.window_of(i) for i in range(2)] == [window if i in layers else None for i in range(2)]
    assert cfg.max_position_embeddings == 4096


def test_a_sliding_window_changes_what_attention_sees():
    """The windowed oracle cases above can tell a window from full attention."""
    base = {**HF_CONFIG, "architectures": ["MistralForCausalLM"]}
    full = ModelConfig.from_hf_dict(base)
    windowed = ModelConfig.from_hf_dict({**base, "sliding_window": 4})
    prompt = list(range(1, 30))
    models = [Transformer(cfg, torch.float32, torch.device("cpu")) for cfg in (full, windowed)]
    for model in models:
        _fill_preset(model, seed=7)  # the same weights
    ours_full, ours_windowed = (full_prefill_logits(m, prompt) for m in models)
    torch.testing.assert_close(ours_full[:4], ours_windowed[:4])  # inside the window: equal
    assert not torch.allclose(ours_full[4:], ours_windowed[4:])


def test_generation_config_eos_ids_are_merged(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert ModelConfig.from_path(tmp_path).eos_token_ids == (2, 7, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert ModelConfig.from_path(tmp_path).eos_token_ids == (2, 5)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ConfigError, match="generation_config.json"):
        ModelConfig.from_path(tmp_path)
