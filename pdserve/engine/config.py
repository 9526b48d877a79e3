"""Engine and model configuration.

``ModelConfig`` is the architecture read from a Hugging Face ``config.json`` (Llama
and Qwen2 families) or from a built-in preset. ``EngineConfig`` is everything an
operator sets: device, dtype, KV budget, batching limits. Both validate eagerly so
that a bad value fails at start-up with a message naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
ROLES = ("prefill", "decode", "hybrid")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration or checkpoint that pdserve cannot serve; the message says why."""


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
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

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
            model_type = raw.get("model_type")
            arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(model_type)
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        scaling = raw.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ConfigError(f"rope_scaling {scaling!r} is not supported")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_theta = raw.get("rope_theta")
        if rope_theta is None:
            rope_theta = (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        try:
            num_heads = int(raw["num_attention_heads"])
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                head_dim=int(raw.get("head_dim") or 0),
                # Qwen2 always has a bias on q/k/v; Llama only when attention_bias is set.
                attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias")),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                eos_token_ids=eos_ids,
                name=name,
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks required field {exc.args[0]!r}") from None

    @classmethod
    def from_path(cls, path: Path) -> ModelConfig:
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"{path} has no config.json")
        try:
            raw = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{config_file} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{config_file} must hold a JSON object")
        return cls.from_hf_dict(raw, name=path.name)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


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
    # KV transfer between engines (disaggregation). "none" turns the connector off.
    kv_transport: str = "none"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_auth_token: str | None = None
    kv_transfer_timeout_s: float = 10.0  # one batch of writes/reads
    decode_allocation: str = "dispatch"  # or "prefill_complete"
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
        if self.kv_transport not in ("none", "tcp", "shm", "mooncake"):
            raise ConfigError(f"kv_transport must be none, tcp, shm or mooncake, got {self.kv_transport!r}")
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
