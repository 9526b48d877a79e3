"""pdserve's model against Hugging Face transformers on the same random checkpoints."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import AttentionMetadata, PrefillChunk
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model
from pdserve.engine.sampling_params import SamplingParams
from tests.unit.engine.hf_models import build_hf_model, save_hf_model, save_word_tokenizer

CASES = [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True)]
PROMPT = [5, 17, 99, 3, 250, 42, 42, 7, 64, 128, 1, 300, 11, 23]


def full_prefill_logits(model, token_ids: list[int]) -> torch.Tensor:
    cfg = model.config
    n = len(token_ids)
    kv = torch.zeros(cfg.num_hidden_layers, 2, n, cfg.num_key_value_heads, cfg.head_dim)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillChunk(0, n, n, None, None)])
    hidden = model(torch.tensor(token_ids), torch.arange(n), kv, meta)
    return model.compute_logits(hidden)


@pytest.mark.parametrize(("kind", "tie"), CASES)
def test_logits_match_transformers(tmp_path, kind, tie):
    hf = build_hf_model(kind, tie)
    save_hf_model(hf, tmp_path)
    model, tokenizer = load_model(str(tmp_path))
    assert tokenizer is None
    assert model.config.tie_word_embeddings == tie
    ours = full_prefill_logits(model, PROMPT)
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0].float()
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize(("kind", "tie"), CASES)
def test_greedy_generation_matches_transformers(tmp_path, kind, tie):
    hf = build_hf_model(kind, tie, seed=1)
    save_hf_model(hf, tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=64, block_size=4))
    prompts = [PROMPT, [7, 8, 9], list(range(40, 70))]
    ours = engine.generate(prompts, SamplingParams(max_tokens=24))
    for prompt, out in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                pad_token_id=0,
            )[0, len(prompt):].tolist()
        assert out == ref
        assert len(set(out)) >= 3, f"degenerate reference output {out}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sharded_checkpoint_with_tokenizer(tmp_path):
    hf = build_hf_model("qwen2", tie=False, seed=2)
    save_hf_model(hf, tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    save_word_tokenizer(tmp_path, hf.config.vocab_size)
    model, tokenizer = load_model(str(tmp_path))
    assert tokenizer.encode("w5 w17 w99") == [5, 17, 99]
    ours = full_prefill_logits(model, PROMPT)
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=32))
    req = engine.add_request("r", prompt="w5 w17 w99", sampling_params=SamplingParams(max_tokens=5))
    while engine.has_unfinished:
        engine.step()
    assert req.output_text == tokenizer.decode(req.output_token_ids)
    assert req.output_text.startswith("w")
