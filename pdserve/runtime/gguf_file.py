"""GGUF checkpoints (llama.cpp's single-file format) read as a Hugging Face checkpoint.

``GGUFFile(path)`` maps the file (nothing is read into memory until asked for) and
answers what a checkpoint directory answers:
``hf_config()`` (what ``config.json`` would hold), ``tokenizer()`` (a ``tokenizers``
tokenizer rebuilt from the vocabulary and merges in the metadata), ``chat_template``,
the BOS/EOS ids, and ``tensor(name)`` / ``tensor_names()`` under Hugging Face's tensor
names and layouts, dequantized to float32 by ``gguf.quants``. The control plane uses
the metadata only (no torch here); the engine loads the tensors.

The header is read by ``GGUFIndex`` (the format's key/value metadata and tensor table,
read with ``struct`` in one pass): the ``gguf`` package's ``GGUFReader`` builds a numpy
view per part of every field, 2-17 s for SmolLM2's 49,152 tokens and 48,900 merges
depending on the CPU, where this takes a fraction of a second; the tensors' bytes are
dequantized by ``gguf.quants`` as before. An engine's start still asks four times
(config, model check, weights, tokenizer): inside ``parsed_once()`` every ``GGUFFile``
of the same file (path, size, modification time) shares one parse; on leaving it the
parse is dropped, so neither the parsed fields nor the file's mapped pages stay for
the process's life.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

GGUF_SUFFIX = ".gguf"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED_QK = ("llama", "mistral")  # llama.cpp interleaves these q/k rows for its RoPE
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_PATTERNS = {
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "dbrx": _LLAMA3, "smaug-bpe": _LLAMA3,
    "qwen2": _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}"),
}
"""``tokenizer.ggml.pre`` values whose split differs from GPT-2's (which ByteLevel's own
expression applies: ``gpt2``, ``smollm``, ``default`` and the rest)."""

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


class GGUFError(ValueError):
    """A GGUF file pdserve cannot serve; the message names the file and what."""


def is_gguf(location: str | Path) -> bool:
    """Whether a model location names a GGUF file (by its suffix; it may not exist)."""
    return str(location).lower().endswith(GGUF_SUFFIX)


def hf_tensor_name(name: str) -> str | None:
    """The Hugging Face name of GGUF tensor ``name`` (None: not a weight pdserve uses)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def _unpermute(rows, num_heads: int):
    """Undo llama.cpp's q/k row order: per head, its first-half and second-half rows
    (Hugging Face's rotate-half pairs) were interleaved."""
    head_rows = rows.shape[0] // num_heads
    shaped = rows.reshape(num_heads, head_rows // 2, 2, *rows.shape[1:])
    return shaped.swapaxes(1, 2).reshape(rows.shape)


_shared: dict | None = None  # (path, size, mtime) -> reader, inside ``parsed_once``


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Share one parse per file among the ``GGUFFile`` objects made inside (an engine's
    or a Coordinator's start); nested uses share the outermost one's."""
    global _shared
    outermost = _shared is None
    if outermost:
        _shared = {}
    try:
        yield
    finally:
        if outermost:
            _shared = None


def _parse(path: Path) -> GGUFIndex:
    if _shared is None:
        return GGUFIndex(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)  # a changed file: parsed again
    if key not in _shared:
        _shared[key] = GGUFIndex(path)
    return _shared[key]


GGUF_MAGIC, GGUF_VERSIONS, DEFAULT_ALIGNMENT = b"GGUF", (2, 3), 32
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_ARRAY_DTYPES = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                 10: "<u8", 11: "<i8", 12: "<f8"}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One entry of the tensor table: where its bytes are and how they are laid out."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    n_bytes: int
    offset: int  # in the file


class GGUFIndex:
    """A GGUF file's metadata (``fields``: key -> str, int, float, bool or list) and
    tensor table (``tensors``), read from a read-only map of the file (little-endian
    files of format version 2 or 3; anything else, or a header that runs past the file,
    raises ValueError). ``data(tensor)`` is a view of a tensor's bytes, in the array
    shape ``gguf.quants.dequantize`` takes."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf, self._pos = self._map, 0
        if buf[:4] != GGUF_MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        self._pos = 4
        version, num_tensors, num_fields = self._read("<IQQ")
        if version not in GGUF_VERSIONS:
            raise ValueError(f"GGUF version {version} (big-endian, or unsupported; read: {GGUF_VERSIONS})")
        self.fields: dict = {}
        for _ in range(num_fields):
            key = self._string()
            if key in self.fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            (kind,) = self._read("<I")
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (num_dims,) = self._read("<I")
            if num_dims > 8:
                raise ValueError(f"tensor {name!r} has {num_dims} dimensions")
            dims = self._read(f"<{num_dims}Q")
            kind, offset = self._read("<IQ")
            infos.append((name, dims, kind, offset))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(name, dims, kind, data_start + offset) for name, dims, kind, offset in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("a tensor name appears twice")

    def _read(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._map):
            raise ValueError(f"the header runs past the end of the file (at byte {self._pos})")
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += size
        return values

    def _string(self) -> str:
        (length,) = self._read("<Q")
        end = self._pos + length
        if end > len(self._map):
            raise ValueError(f"a string of {length} bytes runs past the end of the file (at byte {self._pos})")
        text = self._map[self._pos:end].decode("utf-8")
        self._pos = end
        return text

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._read("<" + _SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item_kind, count = self._read("<IQ")
        if item_kind in _ARRAY_DTYPES:
            import numpy as np

            dtype = np.dtype(_ARRAY_DTYPES[item_kind])
            if self._pos + count * dtype.itemsize > len(self._map):
                raise ValueError(f"an array of {count} items runs past the end of the file (at byte {self._pos})")
            values = np.frombuffer(self._map, dtype, count, self._pos).tolist()
            self._pos += count * dtype.itemsize
            return values
        if item_kind == _STRING:
            return [self._string() for _ in range(count)]
        return [self._value(item_kind) for _ in range(count)]

    def _tensor(self, name: str, dims: tuple[int, ...], kind: int, offset: int) -> TensorInfo:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            tensor_type = GGMLQuantizationType(kind)
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has an unknown type {kind}") from None
        num_elements = 1
        for n in dims:
            num_elements *= n
        n_bytes = num_elements * type_size // block_size
        if offset + n_bytes > len(self._map):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        return TensorInfo(name, tensor_type, tuple(dims), n_bytes, offset)

    def data(self, tensor: TensorInfo):
        """The tensor's bytes as numpy sees GGUF data: typed for float and integer types,
        bytes per row of blocks for quantized ones (no copy)."""
        import numpy as np
        from gguf.constants import GGMLQuantizationType as Q
        from gguf.quants import quant_shape_to_byte_shape

        shape = tuple(reversed(tensor.shape))
        plain = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8,
                 Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}.get(tensor.tensor_type)
        raw = np.frombuffer(self._map, np.uint8, tensor.n_bytes, tensor.offset)
        if plain is not None:
            return raw.view(plain).reshape(shape)
        return raw.reshape(quant_shape_to_byte_shape(shape, tensor.tensor_type))


class GGUFFile:
    """One GGUF file, opened lazily: ``path`` is checked, the metadata parsed on first use."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @cached_property
    def _reader(self):
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such GGUF file")
        try:
            return _parse(self.path)
        except (ValueError, OSError) as exc:  # incl. UnicodeDecodeError; an empty file: mmap's ValueError
            raise GGUFError(f"{self.path} is not a readable GGUF file: {exc}") from None

    def field(self, key: str, default=None):
        """A metadata value (strings, numbers, lists), or ``default``."""
        return self._reader.fields.get(key, default)

    @cached_property
    def arch(self) -> str:
        arch = self.field("general.architecture")
        if arch not in ARCHITECTURES:
            raise GGUFError(f"{self.path.name}: architecture {arch!r} is not supported "
                            f"(supported: {', '.join(ARCHITECTURES)})")
        return arch

    def _arch_field(self, key: str, default=None):
        return self.field(f"{self.arch}.{key}", default)

    @cached_property
    def _tensors(self) -> dict:
        return {t.name: t for t in self._reader.tensors}

    def hf_config(self) -> dict:
        """What the checkpoint's ``config.json`` would say."""
        heads = self._arch_field("attention.head_count")
        required = {"block_count": self._arch_field("block_count"), "attention.head_count": heads,
                    "embedding_length": self._arch_field("embedding_length"),
                    "feed_forward_length": self._arch_field("feed_forward_length")}
        if missing := [k for k, v in required.items() if v is None]:
            raise GGUFError(f"{self.path.name} lacks metadata {', '.join(f'{self.arch}.{k}' for k in missing)}")
        if self._arch_field("rope.scaling.type", "none") not in ("none", None) or "rope_freqs.weight" in self._tensors:
            raise GGUFError(f"{self.path.name}: RoPE scaling in GGUF files is not supported; "
                            "serve the Hugging Face checkpoint instead")
        vocab = self._arch_field("vocab_size") or len(self.field("tokenizer.ggml.tokens", []))
        config = {
            "architectures": [ARCHITECTURES[self.arch]], "model_type": self.arch,
            "vocab_size": int(vocab), "hidden_size": int(required["embedding_length"]),
            "intermediate_size": int(required["feed_forward_length"]),
            "num_hidden_layers": int(required["block_count"]),
            "num_attention_heads": int(heads),
            "num_key_value_heads": int(self._arch_field("attention.head_count_kv") or heads),
            "max_position_embeddings": int(self._arch_field("context_length", 2048)),
            "rms_norm_eps": float(self._arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._arch_field("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "eos_token_id": self.eos_token_id,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
        }
        if key_length := self._arch_field("attention.key_length"):
            config["head_dim"] = int(key_length)
        return config

    @property
    def eos_token_id(self) -> int | None:
        return self.field("tokenizer.ggml.eos_token_id")

    @property
    def bos_token_id(self) -> int | None:
        """The BOS id a text prompt starts with (None: the file says not to add one)."""
        if not self.field("tokenizer.ggml.add_bos_token", False):
            return None
        return self.field("tokenizer.ggml.bos_token_id")

    @property
    def chat_template(self) -> str | None:
        template = self.field("tokenizer.chat_template")
        return template if isinstance(template, str) and template.strip() else None

    def special_token(self, which: str) -> str:
        """``bos`` or ``eos`` as text, for chat templates ("" when the file has none)."""
        token_id, tokens = self.field(f"tokenizer.ggml.{which}_token_id"), self.field("tokenizer.ggml.tokens", [])
        return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else ""

    def tokenizer(self):
        """The vocabulary as a ``tokenizers.Tokenizer`` (BPE, byte-level)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        kind = self.field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise GGUFError(f"{self.path.name}: tokenizer type {kind!r} is not supported (only BPE, "
                            "'gpt2'); serve the Hugging Face checkpoint with its tokenizer.json")
        tokens = self.field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in self.field("tokenizer.ggml.merges", [])]
        types = self.field("tokenizer.ggml.token_type") or [1] * len(tokens)
        tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
        pattern = PRE_TOKENIZER_PATTERNS.get(self.field("tokenizer.ggml.pre", "default"))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                              use_regex=pattern is None)
        tokenizer.pre_tokenizer = byte_level if pattern is None else pre_tokenizers.Sequence([
            pre_tokenizers.Split(pattern=_regex(pattern), behavior="isolated"), byte_level])
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                      for t, kind in zip(tokens, types, strict=True) if kind == TOKEN_CONTROL])
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                              for t, kind in zip(tokens, types, strict=True) if kind == TOKEN_USER_DEFINED])
        return tokenizer

    def tensor_names(self) -> list[str]:
        """The Hugging Face names of every weight the file holds."""
        return [hf for name in self._tensors if (hf := hf_tensor_name(name)) is not None]

    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self._tensors.values())

    def tensor(self, hf_name: str):
        """Weight ``hf_name`` as a float32 numpy array in Hugging Face's layout."""
        from gguf.quants import dequantize

        name = self._gguf_names[hf_name]
        raw = self._tensors[name]
        try:
            values = dequantize(self._reader.data(raw), raw.tensor_type)
        except NotImplementedError:
            raise GGUFError(f"{self.path.name}: tensor {name} has type {raw.tensor_type.name}, "
                            "which cannot be dequantized") from None
        values = values.reshape([int(n) for n in reversed(raw.shape)])
        if self.arch in PERMUTED_QK and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self._arch_field("attention.head_count")
            if name.endswith("attn_k.weight"):
                heads = self._arch_field("attention.head_count_kv") or heads
            values = _unpermute(values, int(heads))
        return values

    @cached_property
    def _gguf_names(self) -> dict[str, str]:
        return {hf: name for name in self._tensors if (hf := hf_tensor_name(name)) is not None}


def _regex(pattern: str):
    from tokenizers import Regex

    return Regex(pattern)
