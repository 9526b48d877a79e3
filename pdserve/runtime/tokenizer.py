"""Tokenizers: Hugging Face ``tokenizer.json`` through ``tokenizers``, and a byte-level one.

The byte tokenizer serves the built-in presets: token ``i < 256`` is byte ``i``; the
ids above are specials (BOS, EOS). Both expose ``encode``/``decode`` and
``eos_token_ids``. A checkpoint without tokenizer files gets ``None`` and runs from
token ids only.
"""

from __future__ import annotations

import json
from pathlib import Path


class ByteTokenizer:
    bos_token_id = 256
    eos_token_id = 257

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.eos_token_id,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        self._eos: tuple[int, ...] = ()
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            try:
                eos = json.loads(config_file.read_text()).get("eos_token")
                if isinstance(eos, dict):
                    eos = eos.get("content")
                if isinstance(eos, str) and self._tok.token_to_id(eos) is not None:
                    self._eos = (self._tok.token_to_id(eos),)
            except (json.JSONDecodeError, UnicodeDecodeError):
                pass

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)


def load_tokenizer(path: Path) -> HFTokenizer | None:
    return HFTokenizer(path) if (path / "tokenizer.json").is_file() else None
