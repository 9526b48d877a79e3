"""Model loading: Hugging Face checkpoint directories and built-in presets.

``load_model(name_or_path, dtype, device)`` returns ``(model, tokenizer)``. A path
must hold ``config.json`` and ``*.safetensors`` (sharded checkpoints through their
index or by globbing). Tensors are read one at a time and copied into the fused
parameters, so peak memory is the model plus one tensor. Presets (``tiny``,
``small``) build their weights deterministically from a seed, offline.

Every problem with a checkpoint raises ``ConfigError`` with a message naming the file
or tensor; nothing here crashes the process. While a checkpoint loads, the log shows
progress (tensors and bytes so far, and the rate) at most every 2 s, then one line
with the totals (``LoadProgress``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.engine.config import ConfigError, ModelConfig
from pdserve.engine.model import Transformer
from pdserve.runtime.tokenizer import ByteTokenizer, load_tokenizer

PRESETS: dict[str, dict] = {
    # ~2M parameters: tests and the default local cluster.
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                 max_position_embeddings=16384, rope_theta=10000.0, seed=1234),
    # ~30M parameters: benchmarks.
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=8192,
                  max_position_embeddings=8192, rope_theta=500000.0, seed=1234),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

log = logging.getLogger(__name__)


class LoadProgress:
    """Log lines while weights load. ``_load_checkpoint`` calls ``add`` per tensor copied
    (engine start-up thread) and ``finish`` once; a line goes out at most every
    ``every_s`` and always at ``finish``."""

    def __init__(self, total_bytes: int, every_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total_bytes = total_bytes  # on disk: what the shards hold, headers included
        self.num_tensors = 0
        self.num_bytes = 0
        self._every_s = every_s
        self._clock = clock
        self._started_s = self._logged_s = clock()

    def add(self, num_bytes: int) -> None:
        self.num_tensors += 1
        self.num_bytes += num_bytes
        now = self._clock()
        if now - self._logged_s >= self._every_s:
            self._logged_s = now
            self._log("loading weights", now)

    def finish(self) -> None:
        self._log("loaded weights", self._clock())

    def _log(self, what: str, now: float) -> None:
        elapsed_s = now - self._started_s
        rate = self.num_bytes / elapsed_s / 2**20 if elapsed_s > 0 else 0.0
        log.info("%s: %d tensors, %s of %s in %.1f s (%.0f MiB/s)", what, self.num_tensors,
                 _size(self.num_bytes), _size(self.total_bytes), elapsed_s, rate)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def preset_config(name: str) -> ModelConfig:
    p = dict(PRESETS[name])
    p.pop("seed")
    return ModelConfig(architecture="LlamaForCausalLM", eos_token_ids=(ByteTokenizer.eos_token_id,),
                       tie_word_embeddings=False, rms_norm_eps=1e-5, name=name, **p)


def _fill_preset(model: Transformer, seed: int) -> None:
    """Deterministic weights with enough spread that greedy outputs vary with the input."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "layernorm" in name or name.startswith("norm"):
            values = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        elif name == "embed_tokens":
            values = torch.randn(param.shape, generator=gen)
        elif param.dim() == 1:  # biases
            values = 0.02 * torch.randn(param.shape, generator=gen)
        else:
            values = torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5
        param.data.copy_(values.to(param.dtype))


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{index} is malformed: {exc}") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"checkpoint shards missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path} has no *.safetensors weights")
    return files


def _target(model: Transformer, name: str) -> tuple[torch.Tensor, int, int] | None:
    """Where a checkpoint tensor goes: (parameter, row offset, rows) for fused weights."""
    cfg = model.config
    if name in ("model.embed_tokens.weight",):
        return model.embed_tokens, 0, cfg.vocab_size
    if name == "model.norm.weight":
        return model.norm.weight, 0, cfg.hidden_size
    if name == "lm_head.weight":
        if model.lm_head is None:
            return None  # tied: the embedding is the head
        return model.lm_head, 0, cfg.vocab_size
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    i = int(parts[2])
    if i >= cfg.num_hidden_layers:
        raise ConfigError(f"tensor {name} names layer {i} but the config has {cfg.num_hidden_layers}")
    layer = model.layers[i]
    attn, mlp = layer.self_attn, layer.mlp
    q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate
    rest = ".".join(parts[3:])
    table = {
        "self_attn.q_proj.weight": (attn.qkv_weight, 0, q),
        "self_attn.k_proj.weight": (attn.qkv_weight, q, kv),
        "self_attn.v_proj.weight": (attn.qkv_weight, q + kv, kv),
        "self_attn.o_proj.weight": (attn.o_weight, 0, cfg.hidden_size),
        "mlp.gate_proj.weight": (mlp.gate_up_weight, 0, inter),
        "mlp.up_proj.weight": (mlp.gate_up_weight, inter, inter),
        "mlp.down_proj.weight": (mlp.down_weight, 0, cfg.hidden_size),
        "input_layernorm.weight": (layer.input_layernorm.weight, 0, cfg.hidden_size),
        "post_attention_layernorm.weight": (layer.post_attention_layernorm.weight, 0, cfg.hidden_size),
    }
    if attn.q_norm is not None:
        table["self_attn.q_norm.weight"] = (attn.q_norm.weight, 0, attn.head_dim)
        table["self_attn.k_norm.weight"] = (attn.k_norm.weight, 0, attn.head_dim)
    if attn.qkv_bias is not None:
        table.update({
            "self_attn.q_proj.bias": (attn.qkv_bias, 0, q),
            "self_attn.k_proj.bias": (attn.qkv_bias, q, kv),
            "self_attn.v_proj.bias": (attn.qkv_bias, q + kv, kv),
        })
    if rest not in table:
        raise ConfigError(f"unexpected tensor {name} in checkpoint")
    return table[rest]


def _load_checkpoint(model: Transformer, path: Path) -> None:
    from safetensors import SafetensorError, safe_open

    expected = {id(p): n for n, p in model.named_parameters()}
    filled: dict[str, int] = {}
    files = _checkpoint_files(path)
    progress = LoadProgress(sum(f.stat().st_size for f in files))
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {file.name}: {exc}") from None
        with handle as f:
            for name in f.keys():
                target = _target(model, name)
                if target is None:
                    continue
                param, offset, rows = target
                tensor = f.get_tensor(name)
                dst = param.data.narrow(0, offset, rows)
                if tuple(tensor.shape) != tuple(dst.shape):
                    raise ConfigError(
                        f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                    )
                dst.copy_(tensor)
                progress.add(tensor.numel() * tensor.element_size())
                pname = expected[id(param)]
                filled[pname] = filled.get(pname, 0) + rows
    progress.finish()
    missing = [n for n, p in model.named_parameters() if filled.get(n, 0) != p.shape[0]]
    if missing:
        raise ConfigError(f"checkpoint lacks weights for: {', '.join(missing[:5])}")


def load_model(name_or_path: str, dtype: str = "float32", device: str = "cpu"):
    """Build the model and its tokenizer. Called once by the engine at start-up."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    torch_dtype, torch_device = DTYPES[dtype], torch.device(device)
    if name_or_path in PRESETS:
        cfg = preset_config(name_or_path)
        model = Transformer(cfg, torch_dtype, torch_device)
        _fill_preset(model, PRESETS[name_or_path]["seed"])
        return model, ByteTokenizer(cfg.vocab_size)
    path = Path(name_or_path)
    if not path.is_dir():
        raise ConfigError(
            f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a directory"
        )
    cfg = ModelConfig.from_path(path)
    model = Transformer(cfg, torch_dtype, torch_device)
    _load_checkpoint(model, path)
    tokenizer = load_tokenizer(path)
    if tokenizer is not None and not cfg.eos_token_ids and tokenizer.eos_token_ids:
        object.__setattr__(cfg, "eos_token_ids", tokenizer.eos_token_ids)
    return model, tokenizer
