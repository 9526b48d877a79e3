"""Random-weight Hugging Face checkpoints saved to disk, for oracle tests."""

from __future__ import annotations

from pathlib import Path

import torch


def build_hf_model(kind: str, tie: bool = False, seed: int = 0):
    import transformers

    common = dict(
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=tie, eos_token_id=None, bos_token_id=None,
    )
    if kind == "llama":
        cfg = transformers.LlamaConfig(rope_theta=10000.0, **common)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen2Config(rope_theta=1000000.0, **common)
        cls = transformers.Qwen2ForCausalLM
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
