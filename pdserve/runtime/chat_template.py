"""A checkpoint's chat template, found where users' checkpoints keep it.

``find_chat_template(path)`` looks, in order, at:
1. ``chat_template.jinja`` in the checkpoint directory (what transformers writes);
2. ``chat_template`` in ``tokenizer_config.json``: a string, or a list of named
   templates (the one named ``default``);
3. a GGUF file's ``tokenizer.chat_template``.
It returns the template (None: the checkpoint has none), where it came from, and the
BOS/EOS tokens as text, which templates use. Read by the Coordinator (``prompts.py``)
and by the doctor, so both say the same. Nothing here raises for a malformed file: a
template that cannot be read is reported as missing, with the reason as its source.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .gguf_file import GGUFError, GGUFFile, is_gguf

JINJA_FILE = "chat_template.jinja"
HOW_TO_ADD = (f"add the model's chat template to the checkpoint as {JINJA_FILE} (or as "
              "chat_template in tokenizer_config.json), or send prompts to /v1/completions")


@dataclass(frozen=True)
class ChatTemplate:
    template: str | None
    source: str  # where it came from, or why there is none
    specials: dict[str, str] = field(default_factory=lambda: {"bos_token": "", "eos_token": ""})


def _special(config: dict, key: str) -> str:
    value = config.get(key)
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else ""


def find_chat_template(path: Path) -> ChatTemplate:
    """The chat template of the checkpoint directory or GGUF file at ``path``."""
    if is_gguf(path):
        try:
            file = GGUFFile(path)
            specials = {"bos_token": file.special_token("bos"), "eos_token": file.special_token("eos")}
            template = file.chat_template
        except GGUFError as exc:
            return ChatTemplate(None, f"unreadable: {exc}")
        return ChatTemplate(template, f"{path.name} (tokenizer.chat_template)" if template
                            else f"none in {path.name}", specials)
    specials, from_config = {"bos_token": "", "eos_token": ""}, None
    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return ChatTemplate(None, f"unreadable: {config_file.name}: {exc}")
        if isinstance(config, dict):
            specials = {"bos_token": _special(config, "bos_token"), "eos_token": _special(config, "eos_token")}
            from_config = config.get("chat_template")
    jinja_file = path / JINJA_FILE
    if jinja_file.is_file():
        try:
            return ChatTemplate(jinja_file.read_text(), JINJA_FILE, specials)
        except (OSError, UnicodeDecodeError) as exc:
            return ChatTemplate(None, f"unreadable: {JINJA_FILE}: {exc}", specials)
    if isinstance(from_config, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in from_config if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return ChatTemplate(named["default"], "tokenizer_config.json (chat_template 'default')", specials)
        return ChatTemplate(None, "tokenizer_config.json lists chat templates but none named 'default'",
                            specials)
    if isinstance(from_config, str):
        return ChatTemplate(from_config, "tokenizer_config.json (chat_template)", specials)
    return ChatTemplate(None, f"none in {path.name} ({JINJA_FILE}, tokenizer_config.json)", specials)
