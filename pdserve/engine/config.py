"""Engine and model configuration.

``ModelConfig`` is the architecture read from a Hugging Face ``config.json`` (Llama,
Mistral, Qwen2 and Qwen3 families; ``generation_config.json`` adds EOS ids), from a
GGUF file's metadata, or from a built-in preset. ``EngineConfig`` is everything an operator sets: device, dtype, KV
budget, batching limits. Both validate eagerly so that a bad value fails at start-up
with a message naming the field.

Invariant: a checkpoint either loads with the positions, norms and attention span it
was trained with, or is refused with ``ConfigError``. RoPE scaling is read from
``rope_scaling`` (transformers 4.x files) or ``rope_parameters`` (5.x); a type
``rope.py`` does not implement is refused, never run as plain RoPE. A sliding window
is kept per layer (``sliding_window``, ``sliding_layers``) and enforced in attention.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.runtime.gguf_file import GGUFError, GGUFFile, is_gguf
from pdserve.runtime.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    from pdserve.engine.sim import SimTiming

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
)
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
ROLES = ("prefill", "decode", "hybrid")
DTYPES = ("float32", "bfloat16", "float16")  # what an engine runs in; "auto" is resolved first
HOST_MEMORY_TRANSPORTS = ("tcp", "shm", "mooncake", "nixl")
"""KV transports that read and write the KV cache as host memory: tcp sends from and
receives into host pointers, shm maps /dev/shm, and Mooncake is started with its TCP
protocol and registers the cache without a device location, NIXL registers it as DRAM.
None of them can carry a
cache that lives on an accelerator."""

# Random-weight presets (weights from the seed: loader.py), by name.
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


log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration or checkpoint that pdserve cannot serve; the message says why."""



def kv_heads_of(rank: int, tp_size: int, num_kv_heads: int) -> tuple[int, int]:
    """(first, count) of the KV heads rank ``rank`` of ``tp_size`` holds: its equal share,
    or, with fewer heads than ranks, the one head it replicates (``tp_size /
    num_kv_heads`` consecutive ranks hold each head)."""
    if num_kv_heads >= tp_size:
        count = num_kv_heads // tp_size
        return rank * count, count
    return rank // (tp_size // num_kv_heads), 1


def split_error(tp_size: object, num_kv_heads: int) -> str | None:
    """Why ``num_kv_heads`` cannot be laid out over ``tp_size`` ranks, or None."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        return f"tp_size must be a positive integer, got {tp_size!r}"
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        return (f"{num_kv_heads} KV heads cannot be split over {tp_size} ranks (one must be "
                f"a multiple of the other)")
    return None


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling type and its parameters, as ``rope.inv_freq`` reads them."""

    rope_type: str
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn
    truncate: bool = True  # yarn


def _rope_dict(raw: dict) -> tuple[str, dict]:
    """(field name, RoPE dict) of a config.json: ``rope_scaling`` wins over
    ``rope_parameters``, as in transformers."""
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    rope = raw.get(key) or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{key} must be a JSON object, got {rope!r}")
    if any(isinstance(v, dict) for v in rope.values()):
        raise ConfigError(f"per-layer-type {key} is not supported: {rope!r}")
    return key, rope


def parse_rope_scaling(raw: dict, max_positions: int) -> RopeScaling | None:
    """``None`` for plain RoPE; raises ``ConfigError`` for any type ``rope.py`` lacks."""
    key, rope = _rope_dict(raw)
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{key} type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)}): {rope!r}"
        )
    if float(raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ConfigError("partial_rotary_factor other than 1.0 is not supported")
    if rope_type == "default":
        return None
    original = int(raw.get("original_max_position_embeddings")
                   or rope.get("original_max_position_embeddings") or max_positions)
    factor = rope.get("factor")
    if factor is None and rope_type == "yarn":
        factor = max_positions / original
    try:
        scaling = RopeScaling(
            rope_type=rope_type, factor=float(factor),
            original_max_position_embeddings=original,
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
            attention_factor=rope.get("attention_factor"),
            truncate=bool(rope.get("truncate", True)),
        )
    except (TypeError, ValueError):
        raise ConfigError(f"{key} type {rope_type!r} needs a numeric factor: {rope!r}") from None
    if rope_type == "llama3" and ("low_freq_factor" not in rope or "high_freq_factor" not in rope):
        raise ConfigError(f"{key} type llama3 needs low_freq_factor and high_freq_factor: {rope!r}")
    if scaling.factor < 1.0:
        raise ConfigError(f"{key} factor must be at least 1, got {scaling.factor}")
    if rope_type == "llama3" and scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ConfigError(f"{key} type llama3 needs high_freq_factor > low_freq_factor")
    return scaling


def _sliding_window(raw: dict, arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(the attention window, the layers that use it): Mistral's ``sliding_window`` on
    every layer; Qwen's only with ``use_sliding_window``, on layers from
    ``max_window_layers`` on; ``layer_types`` (transformers 5.x) where the file has it."""
    window = raw.get("sliding_window")
    if arch == "LlamaForCausalLM" or window is None or (
            arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window")):
        return None, ()
    types = raw.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif arch == "MistralForCausalLM":
        layers = tuple(range(num_layers))
    else:
        layers = tuple(range(int(raw.get("max_window_layers", 28)), num_layers))
    if int(window) < 1:
        raise ConfigError(f"sliding_window must be positive, got {window!r}")
    return (int(window), layers) if layers else (None, ())


def _eos_ids(value, source: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else ([] if value is None else [value])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"eos_token_id in {source} must be an int or a list of ints, got {value!r}")
    return tuple(values)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    head_dim: int = 0
    attention_bias: bool = False  # a bias on q/k/v
    o_proj_bias: bool = False  # a bias on o_proj (Llama and Qwen3 with attention_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    # Each token of the layers listed attends to itself and the sliding_window - 1 before it.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    name: str = "model"

    def window_of(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window (None: it attends over the whole context)."""
        return self.sliding_window if layer in self.sliding_layers else None

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_hf_dict(cls, raw: dict, name: str = "model") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = MODEL_TYPES.get(raw.get("model_type"))
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope_theta = _rope_dict(raw)[1].get("rope_theta", raw.get("rope_theta", 10000.0))
        try:
            num_heads = int(raw["num_attention_heads"])
            max_positions = int(raw.get("max_position_embeddings", 2048))
            rope_scaling = parse_rope_scaling(raw, max_positions)
            window, window_layers = _sliding_window(raw, arch, int(raw["num_hidden_layers"]))
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
                max_position_embeddings=max_positions,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                head_dim=int(raw.get("head_dim") or 0),
                # Qwen2 always has a bias on q/k/v and none on o_proj; Llama and Qwen3 put
                # one on all four when attention_bias is set; Mistral never has one.
                attention_bias=arch == "Qwen2ForCausalLM" or (
                    arch != "MistralForCausalLM" and bool(raw.get("attention_bias"))),
                o_proj_bias=arch in ("LlamaForCausalLM", "Qwen3ForCausalLM")
                and bool(raw.get("attention_bias")),
                qk_norm=arch == "Qwen3ForCausalLM",
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                eos_token_ids=_eos_ids(raw.get("eos_token_id"), "config.json"),
                sliding_window=window,
                sliding_layers=window_layers,
                name=name,
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks required field {exc.args[0]!r}") from None

    @classmethod
    def from_path(cls, path: Path) -> ModelConfig:
        if is_gguf(path):
            try:
                return cls.from_hf_dict(GGUFFile(path).hf_config(), name=path.stem)
            except GGUFError as exc:
                raise ConfigError(str(exc)) from None
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"{path} has no config.json")
        cfg = cls.from_hf_dict(_read_json_object(config_file), name=path.name)
        gen_file = path / "generation_config.json"  # chat checkpoints list several EOS ids there
        gen = _read_json_object(gen_file) if gen_file.is_file() else {}
        gen_eos = _eos_ids(gen.get("eos_token_id"), gen_file.name)
        extra = tuple(e for e in gen_eos if e not in cfg.eos_token_ids)
        if extra:
            object.__setattr__(cfg, "eos_token_ids", cfg.eos_token_ids + extra)
        return cfg

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def _read_json_object(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file} must hold a JSON object")
    return raw


@dataclass
class EngineConfig:
    model: str = "tiny"
    device: str = "cpu"
    dtype: str = "float32"
    role: str = "hybrid"
    block_size: int = 16
    # KV budget: a byte budget, or an explicit block count (wins when set).
    kv_cache_bytes: int = 256 * 1024 * 1024
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Most prompt tokens one step prefills (all requests together): bounds how long a new
    # prompt (or, on a hybrid engine, a decode) waits behind a long prefill to one chunk.
    prefill_chunk_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None
    # Linear weights packed for oneDNN at load where that is faster (CPU, bfloat16, a CPU
    # with bfloat16 matmuls: prepack.py); False keeps plain F.linear everywhere.
    prepack_weights: bool = True
    # The dense parts of prefill steps compiled by torch.compile at start (compiled.py:
    # CPU, bfloat16, packed weights, no tensor parallelism); PDSERVE_COMPILE=0 also turns it off.
    compile_prefill: bool = True
    # Ranks one engine shards its weights and KV heads over (parallel.py).
    tensor_parallel_size: int = 1
    # KV transfer between engines (disaggregation). "none" turns the connector off.
    kv_transport: str = "none"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_auth_token: str | None = None
    kv_transfer_timeout_s: float = 10.0  # one batch of writes/reads
    decode_allocation: str = "dispatch"  # or "prefill_complete"
    # D takes the prompt's leading blocks from its own prefix cache; P sends only the rest.
    kv_partial_transfer: bool = True
    # Mooncake's protocol ("tcp", or "rdma" over the named NICs, e.g. "mlx5_0,mlx5_1").
    kv_mooncake_protocol: str = "tcp"
    kv_mooncake_devices: str = ""
    # The cluster's shared KV pool: host:port of its Mooncake Store master ("": none),
    # and the memory this engine contributes to it.
    kv_pool: str = ""
    kv_pool_segment_bytes: int = 256 << 20
    kv_descriptor_timeout_s: float = 10.0  # P waiting for D's destination blocks
    kv_done_timeout_s: float = 30.0  # D waiting for P's DONE/READY (longer than P's)
    kv_lease_s: float = 30.0  # P (pull) holding prefilled blocks for D
    kv_abort_ack_timeout_s: float = 5.0
    # D waiting for free KV blocks to reserve before it refuses the leg ("decode full");
    # below kv_descriptor_timeout_s, so P hears "decode full" rather than timing out.
    kv_reserve_wait_s: float = 2.0
    # Fault injection for tests and drills: delay every KV write job by this long, to
    # widen the window in which a peer can be killed mid-transfer. 0 in production.
    fault_kv_send_delay_s: float = 0.0
    # A timing model instead of the model (sim.py): the engine sleeps through its steps.
    simulate: SimTiming | None = None
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.device.split(":")[0] not in ("cpu", "cuda", "npu"):
            raise ConfigError(f"device must be cpu, cuda or npu, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.kv_cache_bytes < 1:
            raise ConfigError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.kv_transport not in ("none", "tcp", "shm", "mooncake", "nixl"):
            raise ConfigError(
                f"kv_transport must be none, tcp, shm, mooncake or nixl, got {self.kv_transport!r}")
        if self.kv_pool and self.tensor_parallel_size > 1:
            raise ConfigError("the KV pool holds whole blocks; with tensor parallelism each rank "
                              "holds a slice (use tensor_parallel_size 1, or no kv_pool)")
        if self.decode_allocation not in ("dispatch", "prefill_complete"):
            raise ConfigError(
                f"decode_allocation must be dispatch or prefill_complete, got {self.decode_allocation!r}"
            )
        if self.kv_done_timeout_s <= self.kv_descriptor_timeout_s:
            raise ConfigError("kv_done_timeout_s must exceed kv_descriptor_timeout_s (D waits longer than P)")
        if not 0 <= self.kv_reserve_wait_s < self.kv_descriptor_timeout_s:
            raise ConfigError(
                f"kv_reserve_wait_s must be at least 0 and below kv_descriptor_timeout_s "
                f"({self.kv_descriptor_timeout_s:g}; D refuses before P gives up), "
                f"got {self.kv_reserve_wait_s:g}")
        if self.prefill_chunk_tokens < 1:
            raise ConfigError(f"prefill_chunk_tokens must be positive, got {self.prefill_chunk_tokens}")
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError("max_num_batched_tokens must be at least block_size")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}")
        kind = self.device.split(":")[0]
        if kind != "cpu" and self.kv_transport in HOST_MEMORY_TRANSPORTS:
            raise ConfigError(
                f"kv_transport {self.kv_transport!r} moves host memory only and cannot carry a "
                f"KV cache on device {self.device!r}; run this engine with --device cpu, or "
                f"with --kv-transport none (role hybrid: it serves whole requests)")

    def check_model(self, model: ModelConfig) -> None:
        """Whether this engine can shard ``model``; called by ``LLMEngine`` before any
        weight is read (and by the example tests on each example's engine arguments)."""
        tp = self.tensor_parallel_size
        if model.num_attention_heads % tp:
            raise ConfigError(f"num_attention_heads ({model.num_attention_heads}) of {model.name} "
                              f"must be a multiple of tensor_parallel_size ({tp})")
        if error := split_error(tp, model.num_key_value_heads):
            raise ConfigError(f"{model.name}: {error} (KV heads are split across the ranks, or "
                              f"each replicated on tensor_parallel_size / num_key_value_heads "
                              f"ranks)")
        if model.intermediate_size % tp:
            raise ConfigError(f"intermediate_size ({model.intermediate_size}) of {model.name} "
                              f"must be a multiple of tensor_parallel_size ({tp})")


def preset_config(name: str) -> ModelConfig:
    """A random-weight preset's architecture (torch-free: the simulated engine reads it)."""
    p = dict(PRESETS[name])
    p.pop("seed")
    return ModelConfig(architecture="LlamaForCausalLM", eos_token_ids=(ByteTokenizer.eos_token_id,),
                       tie_word_embeddings=False, rms_norm_eps=1e-5, name=name, **p)
