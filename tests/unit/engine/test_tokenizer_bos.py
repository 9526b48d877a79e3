"""BOS for text prompts: where the checkpoint's tokenizer files ask for it, and only then."""

from __future__ import annotations

import json

import pytest

from pdserve.runtime.tokenizer import load_tokenizer
from tests.unit.engine.hf_models import save_word_tokenizer

VOCAB = 320


def save_tokenizer(path, add_bos_token, post_processor: bool) -> None:
    from tokenizers import Tokenizer, processors

    save_word_tokenizer(path, VOCAB)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(["<s>"])  # a new id: VOCAB
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", VOCAB)])
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "w1"}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("add_bos_token", "post_processor", "expect_bos"), [
    (True, False, True),  # Llama 2 / Mistral: tokenizer_config asks
    (None, True, True),  # Llama 3: the tokenizer.json post-processor adds it
    (False, True, False),  # the explicit setting wins over the post-processor
    (None, False, False),  # Qwen: no BOS anywhere
])
def test_text_prompts_get_bos_where_the_checkpoint_asks(tmp_path, add_bos_token, post_processor, expect_bos):
    save_tokenizer(tmp_path, add_bos_token, post_processor)
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_ids == (1,)
    assert tok.encode("w5 w17") == [5, 17]  # chat prompts: the template writes BOS itself
    assert tok.encode("w5 w17", add_bos=True) == ([VOCAB] if expect_bos else []) + [5, 17]


def test_text_completions_get_bos_in_the_coordinator_and_the_engine_chat_does_not(tmp_path):
    from pdserve.coordinator.prompts import PromptBuilder
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from tests.unit.engine.hf_models import build_hf_model, save_hf_model

    save_tokenizer(tmp_path, True, post_processor=False)
    pb = PromptBuilder(str(tmp_path))
    assert pb.encode_text("w5 w17", add_bos=True) == [VOCAB, 5, 17]  # text completion
    assert pb.encode_text("w5 w17") == [5, 17]  # a rendered chat prompt
    save_hf_model(build_hf_model("llama", vocab_size=VOCAB + 1, num_hidden_layers=1), tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=16))
    assert engine.add_request("r", prompt="w5 w17").prompt_token_ids == [VOCAB, 5, 17]
