"""Tokenizers: Hugging Face ``tokenizer.json`` (or a GGUF file's vocabulary) through
``tokenizers``, and a byte-level one.

The byte tokenizer serves the built-in presets: token ``i < 256`` is byte ``i``; the
ids above are specials (BOS, EOS). Both expose ``encode``/``decode`` and
``eos_token_ids``. A checkpoint without tokenizer files gets ``None`` and runs from
token ids only.

BOS: ``encode(text, add_bos=True)`` (for a text completion's prompt, as Hugging Face
encodes ``tokenizer(text)``) puts ``bos_token_id`` first where the checkpoint asks for
it: ``add_bos_token`` in ``tokenizer_config.json``, or, where that is absent, a
``tokenizer.json`` post-processor that adds it; a GGUF file's ``add_bos_token``. Chat prompts keep ``add_bos=False``:
their template writes the BOS token into the text.
"""

from __future__ import annotations

import json
from pathlib import Path

from .gguf_file import GGUFFile, is_gguf


class ByteTokenizer:
    bos_token_id = 256
    eos_token_id = 257

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.eos_token_id,)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return list(text.encode("utf-8"))  # presets are trained without BOS

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the checkpoint's EOS ids and BOS rule; built by
    ``load_tokenizer``."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...] = (),
                 bos_token_id: int | None = None) -> None:
        self._tok = tokenizer
        self._eos = eos_token_ids
        self.bos_token_id = bos_token_id  # put first by encode(add_bos=True)

    @classmethod
    def from_dir(cls, path: Path) -> HFTokenizer:
        from tokenizers import Tokenizer

        self = cls(Tokenizer.from_file(str(path / "tokenizer.json")))
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                config = {}
            config = config if isinstance(config, dict) else {}
            eos, bos = self._special_id(config, "eos_token"), self._special_id(config, "bos_token")
            self._eos = () if eos is None else (eos,)
            add_bos = config.get("add_bos_token")
            if add_bos is None:  # the fast tokenizer's post-processor decides, as in HF
                add_bos = self._tok.encode("", add_special_tokens=True).ids[:1] == [bos]
            self.bos_token_id = bos if add_bos else None
        return self

    def _special_id(self, config: dict, key: str) -> int | None:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        return self._tok.token_to_id(value) if isinstance(value, str) else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` holds it (what llguidance reads)."""
        return self._tok.to_str()

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)


def load_tokenizer(path: Path) -> HFTokenizer | None:
    """The tokenizer of a checkpoint directory or GGUF file (None: a directory without
    ``tokenizer.json``)."""
    if is_gguf(path):
        file = GGUFFile(path)
        eos = file.eos_token_id
        return HFTokenizer(file.tokenizer(), () if eos is None else (eos,), file.bos_token_id)
    return HFTokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
