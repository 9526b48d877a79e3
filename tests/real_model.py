"""The real model the tests judge behaviour on: SmolLM2-135M-Instruct.

``gguf_path()`` is the ``smollm2`` preset's GGUF file, installed by pdserve's own
on-demand install (``model_source.resolve``). ``hf_checkpoint()`` is that file
dequantized to float32 by transformers (its own GGUF reader, not pdserve's) and saved
as a Hugging Face checkpoint, as a user would convert it: ``config.json``,
``model.safetensors``, ``tokenizer.json`` and ``chat_template.jinja`` (transformers
writes the template there, not into ``tokenizer_config.json``). Converted once per
machine into ``CACHE_DIR`` (a temporary directory renamed into place, so a run that
dies half-way leaves nothing behind), then reused.

``Reference`` is transformers on that checkpoint: the oracle for tokenization, chat
templates and greedy token ids.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from functools import cache
from pathlib import Path

from pdserve.runtime.model_source import PACKAGED_PRESETS, resolve

PRESET = "smollm2"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve-tests"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@cache
def gguf_path() -> Path:
    return Path(resolve(PRESET))


@cache
def hf_checkpoint() -> Path:
    target = CACHE_DIR / f"smollm2-{PACKAGED_PRESETS[PRESET].version}-float32"
    if (target / "model.safetensors").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    source = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                     dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are float32 now
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=CACHE_DIR, prefix=".convert-"))
    try:
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        work.rename(target)
    except OSError:
        shutil.rmtree(work, ignore_errors=True)
        if not (target / "model.safetensors").is_file():
            raise
    return target


class Reference:
    """transformers on the converted checkpoint, float32, greedy."""

    def __init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = hf_checkpoint()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def chat_ids(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """Greedy continuation, stopping at EOS (included) as pdserve's engine does."""
        import torch

        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens,
                                      do_sample=False, pad_token_id=self.tokenizer.eos_token_id)
        return out[0][len(prompt_ids):].tolist()
