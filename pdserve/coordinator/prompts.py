"""Prompts in, text out: the model's tokenizer, the chat template and the detokenizer.

The Coordinator tokenizes every text prompt itself, so it can hash prefixes for
routing and count usage, and sends token ids to engines. It also turns output
token ids back into text (not the engines' text): a request that continues on a
new engine pair after a failure then reads as one unbroken stream.

Chat template: the checkpoint's (``runtime.chat_template``: ``chat_template.jinja``,
``tokenizer_config.json``, or the GGUF file's), rendered with jinja2 in a sandbox, as
Hugging Face does, with its ``tojson`` that leaves ``<`` and non-ASCII text as they
are. A checkpoint without one is refused chat (400 saying how to add one); no
template is ever made up for a real model. The random-weight presets, which have no
checkpoint, use ``PRESET_CHAT_TEMPLATE``: one ``<|role|>`` line before each message's
content, then ``<|assistant|>``. Tools reach the template as ``tools`` (OpenAI's tool
objects, as Hugging Face passes them); the preset template lists them in a first
system turn and writes an assistant's earlier calls in the format ``structured.py``
constrains calls to. ``template_source`` says which template serves (``/ready?verbose=1``).
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.runtime.chat_template import HOW_TO_ADD, find_chat_template
from pdserve.runtime.detokenizer import Detokenizer
from pdserve.runtime.gguf_file import parsed_once
from pdserve.runtime.model_source import resolve
from pdserve.runtime.tokenizer import ByteTokenizer, load_tokenizer

from .errors import ServeError

PRESET_VOCAB = {"tiny": 320, "small": 8192}
PRESET_CHAT_TEMPLATE = (
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
        template, self._specials = None, {"bos_token": "", "eos_token": ""}
        if model in PRESET_VOCAB:
            self.vocab_size = PRESET_VOCAB[model]
            self.tokenizer = ByteTokenizer(self.vocab_size)
            template, self.template_source = PRESET_CHAT_TEMPLATE, "built-in (random-weight preset)"
        else:
            path = Path(resolve(model))
            with parsed_once():  # one parse of a GGUF file for both
                if path.exists():
                    self.tokenizer = load_tokenizer(path)
                found = find_chat_template(path)
            template, self.template_source, self._specials = found.template, found.source, found.specials
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self._template = None
        if template is not None:
            try:
                self._template = env.from_string(template)
            except TemplateError as exc:
                self.template_source = f"does not compile: {exc}"

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
        if self._template is None:
            raise ServeError(400, f"this model has no chat template ({self.template_source}): "
                                  f"{HOW_TO_ADD}", param="messages")
        try:
            return self._template.render(messages=messages, tools=tools,
                                         add_generation_prompt=True, **self._specials)
        except TemplateError as exc:
            raise ServeError(400, f"chat template: {exc}", param="messages") from None

    def detokenizer(self, stop: list[str]) -> Detokenizer:
        return Detokenizer(self.tokenizer, stop)
