"""Prompts in, text out: the model's tokenizer, the chat template and the detokenizer.

The Coordinator tokenizes every text prompt itself, so it can hash prefixes for
routing and count usage, and sends token ids to engines. It also turns output
token ids back into text (not the engines' text): a request that continues on a
new engine pair after a failure then reads as one unbroken stream.

Chat template: the checkpoint's ``tokenizer_config.json`` ``chat_template``
(rendered with jinja2 in a sandbox, as Hugging Face does, with its ``tojson`` that
leaves ``<`` and non-ASCII text as they are), else ``DEFAULT_CHAT_TEMPLATE``: one
``<|role|>`` line before each message's content, then ``<|assistant|>``. Tools reach
the template as ``tools`` (OpenAI's tool objects, as Hugging Face passes them); the
default template lists them in a first system turn and writes an assistant's earlier
calls in the format ``structured.py`` constrains calls to.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.runtime.detokenizer import Detokenizer
from pdserve.runtime.tokenizer import ByteTokenizer, load_tokenizer

from .errors import ServeError

PRESET_VOCAB = {"tiny": 320, "small": 8192}
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nTools you may call, each call written as <tool_call>\\n"
    "{\"name\": ..., \"arguments\": {...}}\\n</tool_call>:\n"
    "{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": {{ c.function.name | tojson }}, "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>\n{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None,
            sort_keys: bool = False) -> str:
    """Hugging Face's ``tojson`` for chat templates: plain JSON (jinja2's escapes ``<``)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class PromptBuilder:
    """Owns the tokenizer and chat template of the served model; built once per app."""

    def __init__(self, model: str) -> None:
        self.tokenizer = None
        self.vocab_size: int | None = None
        template, self._specials = DEFAULT_CHAT_TEMPLATE, {"bos_token": "", "eos_token": ""}
        if model in PRESET_VOCAB:
            self.vocab_size = PRESET_VOCAB[model]
            self.tokenizer = ByteTokenizer(self.vocab_size)
        elif Path(model).is_dir():
            self.tokenizer = load_tokenizer(Path(model))
            template = self._read_config(Path(model)) or template
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self._template = env.from_string(template)

    def _read_config(self, path: Path) -> str | None:
        config_file = path / "tokenizer_config.json"
        if not config_file.is_file():
            return None
        config = json.loads(config_file.read_text())
        for key in ("bos_token", "eos_token"):
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            self._specials[key] = value if isinstance(value, str) else ""
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    def encode_text(self, text: str, add_bos: bool = False) -> list[int]:
        """Called by the app: a text completion's prompt with ``add_bos`` (BOS first where
        the checkpoint asks for it), a rendered chat prompt without (its template has it)."""
        if self.tokenizer is None:
            raise ServeError(400, "this model has no tokenizer: send prompt token ids", param="prompt")
        return self.tokenizer.encode(text, add_bos=add_bos)

    def check_ids(self, token_ids: list[int]) -> list[int]:
        if self.vocab_size is not None and any(t >= self.vocab_size for t in token_ids):
            raise ServeError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        if any(t < 0 for t in token_ids):
            raise ServeError(400, "prompt token ids must be non-negative", param="prompt")
        return token_ids

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Called by the app for /v1/chat/completions: messages (and the tools the model
        may call) -> prompt text."""
        try:
            return self._template.render(messages=messages, tools=tools,
                                         add_generation_prompt=True, **self._specials)
        except TemplateError as exc:
            raise ServeError(400, f"chat template: {exc}", param="messages") from None

    def detokenizer(self, stop: list[str]) -> Detokenizer:
        return Detokenizer(self.tokenizer, stop)
