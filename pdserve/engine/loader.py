"""Model loading: Hugging Face checkpoint directories, GGUF files and built-in presets.

``load_model(name_or_path, dtype, device, tp)`` returns ``(model, tokenizer)``. A
directory must hold ``config.json`` and ``*.safetensors`` (sharded checkpoints through
their index or by globbing); a ``.gguf`` file is read through ``runtime.gguf_file``
(each tensor dequantized to float32 as it is copied, ``_GGUFTensors``); a packaged
preset (``smollm2``) is its GGUF file (``runtime.model_source.resolve``). Tensors are read one at a time and copied into the fused
parameters, so peak memory is the model plus one tensor. With tensor parallelism a
rank reads only its slice of each split tensor (rows of q/k/v/gate/up, columns of
o/down: ``_Slice``), the rest whole. Random presets (``tiny``,
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdserve.engine.config import PRESETS, ConfigError, EngineConfig, ModelConfig, preset_config
from pdserve.engine.device import prepare_device
from pdserve.engine.model import Transformer
from pdserve.engine.parallel import TensorParallel, rank_device
from pdserve.engine.prepack import prepack_linears
from pdserve.runtime.gguf_file import GGUFError, GGUFFile, is_gguf, parsed_once
from pdserve.runtime.model_source import PRESETS as ALL_PRESETS
from pdserve.runtime.model_source import ModelSourceError, resolve
from pdserve.runtime.tokenizer import ByteTokenizer, load_tokenizer

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


@dataclass(frozen=True)
class _Slice:
    """The part of a checkpoint tensor this rank holds: ``length`` of its ``full`` rows
    (dim 0) or columns (dim 1) from ``start``."""

    dim: int
    start: int
    length: int
    full: int


def _target(model: Transformer, name: str) -> tuple[torch.Tensor, int, int, _Slice | None] | None:
    """Where a checkpoint tensor goes: (parameter, row offset, rows) for fused weights,
    and the slice of the tensor this rank takes (None: all of it)."""
    cfg = model.config
    if name in ("model.embed_tokens.weight",):
        return model.embed_tokens, 0, cfg.vocab_size, None
    if name == "model.norm.weight":
        return model.norm.weight, 0, cfg.hidden_size, None
    if name == "lm_head.weight":
        if model.lm_head is None:
            return None  # tied: the embedding is the head
        return model.lm_head, 0, cfg.vocab_size, None
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    i = int(parts[2])
    if i >= cfg.num_hidden_layers:
        raise ConfigError(f"tensor {name} names layer {i} but the config has {cfg.num_hidden_layers}")
    rest = ".".join(parts[3:])
    table = _layer_table(model, i)
    if rest not in table:
        raise ConfigError(f"unexpected tensor {name} in checkpoint")
    return table[rest]


def _layer_table(model: Transformer, i: int) -> dict[str, tuple[torch.Tensor, int, int, _Slice | None]]:
    """Layer ``i``'s checkpoint tensor names (after ``model.layers.<i>.``) and targets."""
    cfg, tp = model.config, model.tp
    layer = model.layers[i]
    attn, mlp = layer.self_attn, layer.mlp
    q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate
    d = attn.head_dim
    rows_q = _Slice(0, tp.rank * q, q, cfg.num_attention_heads * d)
    rows_kv = _Slice(0, tp.kv_heads(cfg.num_key_value_heads)[0] * d, kv, cfg.num_key_value_heads * d)
    rows_inter = _Slice(0, tp.rank * inter, inter, cfg.intermediate_size)
    cols_o = _Slice(1, rows_q.start, q, rows_q.full)
    cols_down = _Slice(1, rows_inter.start, inter, rows_inter.full)
    table = {
        "self_attn.q_proj.weight": (attn.qkv_weight, 0, q, rows_q),
        "self_attn.k_proj.weight": (attn.qkv_weight, q, kv, rows_kv),
        "self_attn.v_proj.weight": (attn.qkv_weight, q + kv, kv, rows_kv),
        "self_attn.o_proj.weight": (attn.o_weight, 0, cfg.hidden_size, cols_o),
        "mlp.gate_proj.weight": (mlp.gate_up_weight, 0, inter, rows_inter),
        "mlp.up_proj.weight": (mlp.gate_up_weight, inter, inter, rows_inter),
        "mlp.down_proj.weight": (mlp.down_weight, 0, cfg.hidden_size, cols_down),
        "input_layernorm.weight": (layer.input_layernorm.weight, 0, cfg.hidden_size, None),
        "post_attention_layernorm.weight": (layer.post_attention_layernorm.weight, 0, cfg.hidden_size, None),
    }
    if attn.q_norm is not None:
        table["self_attn.q_norm.weight"] = (attn.q_norm.weight, 0, attn.head_dim, None)
        table["self_attn.k_norm.weight"] = (attn.k_norm.weight, 0, attn.head_dim, None)
    if attn.qkv_bias is not None:
        table.update({
            "self_attn.q_proj.bias": (attn.qkv_bias, 0, q, rows_q),
            "self_attn.k_proj.bias": (attn.qkv_bias, q, kv, rows_kv),
            "self_attn.v_proj.bias": (attn.qkv_bias, q + kv, kv, rows_kv),
        })
    if attn.o_bias is not None:
        table["self_attn.o_proj.bias"] = (attn.o_bias, 0, cfg.hidden_size, None)
    return table


class _PresetTensors:
    """A preset's weights as checkpoint tensors (the ``safe_open`` calls ``_copy_tensor``
    makes), from the whole model filled by ``_fill_preset``: every rank of a sharded
    preset cuts its slices from the same weights, so its outputs equal the unsharded
    preset's."""

    def __init__(self, full: Transformer) -> None:
        names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        for i in range(full.config.num_hidden_layers):
            names += [f"model.layers.{i}.{rest}" for rest in _layer_table(full, i)]
        self.tensors = {}
        for name in names:
            target = _target(full, name)
            if target is not None:
                param, offset, rows, _ = target
                self.tensors[name] = param.data.narrow(0, offset, rows)

    def keys(self):
        return self.tensors.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get_slice(self, name: str) -> _TensorSlice:
        return _TensorSlice(self.tensors[name])


class _TensorSlice:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


def _read(handle, name: str, part: _Slice | None, expected: tuple[int, ...]) -> torch.Tensor:
    """Tensor ``name`` (this rank's ``part`` of it), checked against ``expected``, the
    destination's shape."""
    if part is None:
        tensor = handle.get_tensor(name)
        if tuple(tensor.shape) != expected:
            raise ConfigError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {expected}")
        return tensor
    sliced = handle.get_slice(name)
    shape = tuple(sliced.get_shape())
    full = list(expected)
    full[part.dim] = part.full
    if shape != tuple(full):
        raise ConfigError(f"tensor {name} has shape {shape}, expected {tuple(full)}")
    end = part.start + part.length
    return sliced[part.start:end] if part.dim == 0 else sliced[:, part.start:end]


class _GGUFTensors:
    """A GGUF file's weights as checkpoint tensors (the calls ``_copy_tensors`` makes),
    each dequantized when read."""

    def __init__(self, file: GGUFFile) -> None:
        self.file = file

    def keys(self):
        return self.file.tensor_names()

    def get_tensor(self, name: str) -> torch.Tensor:
        try:
            return torch.from_numpy(np.require(self.file.tensor(name), requirements="W"))
        except GGUFError as exc:
            raise ConfigError(str(exc)) from None

    def get_slice(self, name: str) -> _TensorSlice:
        return _TensorSlice(self.get_tensor(name))


def _load_checkpoint(model: Transformer, path: Path) -> None:
    from safetensors import SafetensorError, safe_open

    filled: dict[str, int] = {}
    if is_gguf(path):
        file = GGUFFile(path)
        progress = LoadProgress(file.tensor_bytes())
        _copy_tensors(model, _GGUFTensors(file), filled, progress)
        progress.finish()
        _check_filled(model, filled)
        return
    files = _checkpoint_files(path)
    progress = LoadProgress(sum(f.stat().st_size for f in files))
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {file.name}: {exc}") from None
        with handle as f:
            _copy_tensors(model, f, filled, progress)
    progress.finish()
    _check_filled(model, filled)


def _copy_tensors(model: Transformer, handle, filled: dict[str, int], progress=None) -> None:
    """Copy every tensor of ``handle`` (an open safetensors file, or ``_PresetTensors``)
    into its parameter; ``filled`` counts the rows each parameter got."""
    names = {id(p): n for n, p in model.named_parameters()}
    for name in handle.keys():
        target = _target(model, name)
        if target is None:
            continue
        param, offset, rows, part = target
        dst = param.data.narrow(0, offset, rows)
        tensor = _read(handle, name, part, tuple(dst.shape))
        dst.copy_(tensor)
        if progress is not None:
            progress.add(tensor.numel() * tensor.element_size())
        filled[names[id(param)]] = filled.get(names[id(param)], 0) + rows


def _check_filled(model: Transformer, filled: dict[str, int]) -> None:
    missing = [n for n, p in model.named_parameters() if filled.get(n, 0) != p.shape[0]]
    if missing:
        raise ConfigError(f"checkpoint lacks weights for: {', '.join(missing[:5])}")


def model_config(name_or_path: str) -> ModelConfig:
    """The architecture of a preset or checkpoint, before any weight is read; called by
    ``LLMEngine`` to check the engine's settings against it."""
    if name_or_path in PRESETS:
        return preset_config(name_or_path)
    path = Path(_resolve(name_or_path))
    if not path.is_dir() and not (is_gguf(path) and path.is_file()):
        raise ConfigError(f"model {name_or_path!r} is neither a preset ({', '.join(ALL_PRESETS)}), "
                          "a directory nor a .gguf file")
    return ModelConfig.from_path(path)


def _resolve(name_or_path: str) -> str:
    try:
        return resolve(name_or_path)
    except ModelSourceError as exc:
        raise ConfigError(str(exc)) from None


def load_rank0(config: EngineConfig) -> tuple[Transformer, object, int]:
    """The engine's model, tokenizer and KV block count on rank 0 (the engine's own
    process); the other tensor-parallel ranks, if any, have loaded their shards when it
    returns, and their KV caches follow rank 0's."""
    tp = TensorParallel(0, config.tensor_parallel_size)
    device = config.device if tp.size == 1 else rank_device(config.device, 0)
    prepare_device(device, config.num_threads)
    model, tokenizer = load_model(config.model, config.dtype, device, tp, config.prepack_weights)
    dtype_bytes = model.embed_tokens.element_size()
    bytes_per_block = model.config.kv_bytes_per_token(dtype_bytes) * config.block_size
    num_blocks = config.num_kv_blocks or config.kv_cache_bytes // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(
            f"kv_cache_bytes={config.kv_cache_bytes} is below one block ({bytes_per_block} bytes)"
        )
    return model, tokenizer, num_blocks


def load_model(name_or_path: str, dtype: str = "float32", device: str = "cpu",
               tp: TensorParallel = TensorParallel(), prepack: bool = True):
    """Build the model (this rank's shard of it) and its tokenizer. Called once by the
    engine at start-up, and by each tensor-parallel worker. ``prepack``: the linear
    weights are packed for oneDNN once loaded, where the device and dtype gain from it
    (``prepack.prepack_linears``)."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    with parsed_once():  # config, weights and tokenizer from one parse of a GGUF file
        return _load_model(name_or_path, DTYPES[dtype], torch.device(device), tp, prepack)


def _load_model(name_or_path: str, torch_dtype: torch.dtype, torch_device: torch.device,
                tp: TensorParallel, prepack: bool):
    cfg = model_config(name_or_path)
    model = Transformer(cfg, torch_dtype, torch_device, tp)
    if name_or_path in PRESETS:
        seed = PRESETS[name_or_path]["seed"]
        if tp.size == 1:
            _fill_preset(model, seed)
        else:
            full = Transformer(cfg, torch_dtype, torch.device("cpu"))
            _fill_preset(full, seed)
            filled: dict[str, int] = {}
            _copy_tensors(model, _PresetTensors(full), filled)
            _check_filled(model, filled)
        if prepack:
            prepack_linears(model)
        return model, ByteTokenizer(cfg.vocab_size)
    path = Path(_resolve(name_or_path))
    _load_checkpoint(model, path)
    if prepack:
        prepack_linears(model)
    tokenizer = load_tokenizer(path)
    if tokenizer is not None and not cfg.eos_token_ids and tokenizer.eos_token_ids:
        object.__setattr__(cfg, "eos_token_ids", tokenizer.eos_token_ids)
    return model, tokenizer
