"""pdserve's model against Hugging Face transformers on the same random checkpoints, and
bfloat16's prepacked linears against the plain ones."""

from __future__ import annotations

import pytest
import torch

from pdserve.api.sampling import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model
from pdserve.engine.prepack import can_prepack
from tests.unit.engine.hf_models import (
    build_hf_model,
    full_prefill_logits,
    hf_greedy,
    save_hf_model,
    save_word_tokenizer,
)

CASES = [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True)]
PROMPT = [5, 17, 99, 3, 250, 42, 42, 7, 64, 128, 1, 300, 11, 23]


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
        ref = hf_greedy(hf, prompt, 24)
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


def packed_count(engine: LLMEngine) -> int:
    return sum(p.is_mkldnn for p in engine.runner.model.parameters())


@pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.bfloat16),
                    reason="this CPU has no oneDNN bfloat16 matmuls")
@pytest.mark.parametrize(("kind", "tie"), CASES)
def test_prepacked_bfloat16_weights_give_the_plain_path_greedy_ids(tmp_path, kind, tie):
    """bfloat16 on CPU: the oneDNN-packed linears (the default) against plain ``F.linear``
    (``prepack_weights=False``) on the same weights, with and without a q/k/v bias and a
    tied head. The float32 cases above hold the path to transformers."""
    hf = build_hf_model(kind, tie, seed=1)
    save_hf_model(hf, tmp_path)
    prompts = [PROMPT, [7, 8, 9], list(range(40, 70))]
    outs = {}
    for prepack in (True, False):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="bfloat16", num_kv_blocks=64,
                                        block_size=4, prepack_weights=prepack))
        model = engine.runner.model
        layers = model.config.num_hidden_layers
        # Four linears a layer and the head; a tied head is packed as a copy, and the
        # embedding stays plain (it is gathered by token id).
        assert packed_count(engine) == (layers * 4 + 1 if prepack else 0)
        assert not model.embed_tokens.is_mkldnn
        outs[prepack] = engine.generate(prompts, SamplingParams(max_tokens=24))
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert outs[True] == outs[False]
    assert all(len(set(out)) >= 3 for out in outs[True]), outs[True]


def test_weights_stay_plain_where_packing_does_not_pay(tmp_path):
    # float32 (slower packed at batch 1) and presets alike: only bfloat16 on CPU packs.
    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=16))
    assert engine.config.dtype == "float32" and packed_count(engine) == 0
    assert not can_prepack(torch.device("cpu"), torch.float32)
    assert not can_prepack(torch.device("cuda"), torch.bfloat16)
