"""Random-weight Hugging Face checkpoints saved to disk, for oracle tests, and the two
sides of the comparison: pdserve's prefill logits and transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.attention import AttentionMetadata, PrefillChunk

FAMILIES = {  # kind: (config class, model class, rope_theta)
    "llama": ("LlamaConfig", "LlamaForCausalLM", 10000.0),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", 1000000.0),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", 1000000.0),
    "mistral": ("MistralConfig", "MistralForCausalLM", 10000.0),
}


def build_hf_model(kind: str, tie: bool = False, seed: int = 0, **overrides):
    """A random ``kind`` model; ``overrides`` replace config fields (``rope_parameters``,
    ``num_hidden_layers``, ``sliding_window``, ...)."""
    import transformers

    config_cls, model_cls, rope_theta = FAMILIES[kind]
    fields = dict(
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=tie, eos_token_id=None, bos_token_id=None,
        rope_theta=rope_theta,
    )
    if kind == "mistral":
        fields["sliding_window"] = None
    fields.update(overrides)
    cfg = getattr(transformers, config_cls)(**fields)
    cls = getattr(transformers, model_cls)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    # Wider than the default init so that greedy outputs depend on the input.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1 or "embed" in name:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    return model


def save_hf_model(model, path: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json over a made-up vocabulary of ``vocab_size`` words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["<unk>"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(path / "tokenizer.json"))


def full_prefill_logits(model, token_ids: list[int]) -> torch.Tensor:
    """pdserve's logits for every position of one prompt prefilled at once."""
    cfg = model.config
    n = len(token_ids)
    kv = torch.zeros(cfg.num_hidden_layers, 2, n, cfg.num_key_value_heads, cfg.head_dim)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillChunk(0, n, n, None, None)])
    hidden = model(torch.tensor(token_ids), torch.arange(n), kv, meta)
    return model.compute_logits(hidden)


def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (no EOS: exactly ``max_new_tokens``)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()
