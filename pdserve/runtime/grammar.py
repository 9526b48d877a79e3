"""Constraints for grammar-constrained decoding: a request's ``(kind, spec)`` as an
llguidance grammar.

Shared by the Coordinator, which checks a request's constraint before routing it (a
bad schema or regex is a 400 there, never an engine error), and the engines, which
compile the same grammar against their tokenizer (``engine/guided.py``). The kinds
are the wire's (``GuidedDecoding.kind`` in ``engine.proto``):

- ``json_schema``: ``spec`` is a JSON Schema (text); ``json_object``: any JSON
  object (``spec`` unused);
- ``regex``: the whole output matches ``spec`` (Rust ``regex`` syntax);
- ``choice``: ``spec`` is a JSON list of strings, the output is one of them;
- ``grammar``: ``spec`` is a Lark grammar in llguidance's dialect (which embeds JSON
  Schemas with ``%json``) or a GBNF one.

JSON is generated compact (no whitespace between tokens) unless the schema's
``x-guidance`` says otherwise: a free choice of whitespace lets a weak model spend its
whole budget on blanks.

llguidance was chosen over xgrammar: it needs no torch (xgrammar pins its own), ships
wheels for every platform, builds its token masks lazily (no per-grammar
precompilation over the vocabulary) and bridges Hugging Face ``tokenizers`` files
directly.
"""

from __future__ import annotations

import json

import llguidance

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message says why."""


def build_grammar(kind: str, spec: str) -> str:
    """The llguidance grammar (JSON text) of one constraint; raises ``GrammarError``
    for an unknown kind or a spec that is not even well-formed (what only compiling
    finds is reported by ``check_grammar`` and by the engine's compile)."""
    if len(spec) > MAX_SPEC_CHARS:
        raise GrammarError(f"{kind}: the constraint has {len(spec)} characters "
                           f"(at most {MAX_SPEC_CHARS})")
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                                 defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            return llguidance.grammar_from("choice", _choices(spec))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", spec)
    except ValueError as exc:
        raise GrammarError(f"{kind}: {exc}") from None
    raise GrammarError(f"unknown constraint kind {kind!r}; one of {', '.join(KINDS)}")


def check_grammar(kind: str, spec: str) -> None:
    """Compile the constraint without a tokenizer; raises ``GrammarError`` with the
    compiler's first message. Called by the Coordinator before routing."""
    grammar = build_grammar(kind, spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"{kind}: {first_line(messages[0])}")


def first_line(message: str) -> str:
    """The gist of an llguidance message: its first line and any ``error:`` line (the
    others show the grammar and the parser's state)."""
    lines = [line.strip() for line in message.strip().splitlines()]
    if not lines:
        return "invalid grammar"
    gist = [lines[0], *(line for line in lines[1:] if line.startswith("error:"))]
    return " ".join(gist)[:300]


def _choices(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"choice: not a JSON list of strings ({exc})") from None
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and c for c in choices)):
        raise GrammarError("choice: expected a non-empty JSON list of non-empty strings")
    return json.dumps(choices)
