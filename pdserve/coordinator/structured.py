"""Structured output and tool calls at the REST edge: what constraint a request asks
for, and how a tool call's text becomes OpenAI ``tool_calls``.

The output is constrained by the engines (grammar-constrained decoding, see
``runtime/grammar.py``), never parsed into shape after the fact. ``output_format``
(called by serving before routing) reads a body's one constraint source and checks
it, so a bad schema or regex is a 400 naming its field:

- ``response_format``: ``json_object``, or ``json_schema`` (its ``schema``; ``strict``
  changes nothing, the schema is always enforced);
- the vLLM-style ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``;
- ``tools`` with ``tool_choice``. Tools are written into the prompt by the chat
  template (``tools=``, as Hugging Face templates take them). A call is the text
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (the Hermes and
  Qwen convention), several separated by a newline when ``parallel_tool_calls``; a
  newline after a call may also end the output (models write one before their end
  token, and it must not commit them to another call). A tool's ``parameters`` are
  enforced closed: an object schema that declares ``properties`` but leaves
  ``additionalProperties`` unsaid takes no other keys (as OpenAI's strict function
  calling), so arguments hold only what the function takes:
  - ``required``: the output is one or more calls, each to a declared tool with
    arguments valid for its ``parameters``;
  - named (``{"type": "function", "function": {"name": ...}}``): one call to it;
  - ``auto`` (the default with tools): either calls as above, or plain text that does
    not start with ``<tool_call>``. The model chooses with its first tokens; once it
    opened a call the grammar holds it to a valid one;
  - ``none``: the tools are left out of the prompt and the output is plain text.

``ToolCallShaper`` wraps serving's ``ResponseBuilder``: a choice's text is split into
content and calls (``ToolCallText``, incremental, so a stream sends each call as a
``delta.tool_calls`` entry once its closing tag arrived), and a choice that called
tools ends with ``finish_reason`` "tool_calls". A call cut by ``max_tokens`` stays text.
"""

from __future__ import annotations

import contextlib
import functools
import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.runtime.grammar import GrammarError, check_grammar

from .errors import ServeError

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
_COMPACT = {"whitespace_flexible": False}  # as runtime/grammar.py generates JSON
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


# -- request models ----------------------------------------------------------------------

class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(pattern=_NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object')
        return self


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(BaseModel):
    name: str
    arguments: str
    """JSON text, as the model wrote it."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


# -- what the request asks for ------------------------------------------------------------

@dataclass(frozen=True)
class OutputFormat:
    """A request's constraint (``guided``: the wire's kind and spec) and, where tools may
    be called, the tools for the template and how the output is split."""

    guided: tuple[str, str] | None = None
    tools: list[dict] | None = None
    calls_only: bool = False  # required or named: the output is calls from its first token

    def wrap(self, shape):
        """Serving's ``ResponseBuilder``, or a ``ToolCallShaper`` around it."""
        return shape if self.tools is None else ToolCallShaper(shape, self.calls_only)


UNCONSTRAINED = OutputFormat()
_CONSTRAINTS = ("response_format", *_GUIDED, "tools", "tool_choice")


@functools.cache
def _constraint_fields(body_type: type) -> tuple[str, ...]:
    """The fields of ``_CONSTRAINTS`` a request model has (all of them for a type that
    does not say: read with a default)."""
    fields = getattr(body_type, "model_fields", None)
    return _CONSTRAINTS if fields is None else tuple(f for f in _CONSTRAINTS if f in fields)


def output_format(body) -> OutputFormat:
    """Called by serving for every request, before routing. Raises a 400 naming the
    field for a malformed constraint, or for two fields that both constrain. A request
    that sets none of them (the common case) costs a read of each field its model has:
    a missing attribute of a pydantic model is an exception raised and caught."""
    if all(getattr(body, f, None) is None for f in _constraint_fields(type(body))):
        return UNCONSTRAINED
    sources = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            sources.append(("response_format", ("json_object", "")))
        else:
            spec = _schema_text(fmt.json_schema.schema_, "response_format.json_schema.schema")
            sources.append(("response_format.json_schema.schema", ("json_schema", spec)))
    for field, kind in _GUIDED.items():
        value = getattr(body, field, None)
        if value is None:
            continue
        if kind == "json_schema":
            spec = _schema_text(value, field)
        else:
            spec = json.dumps(value) if kind == "choice" else value
        sources.append((field, (kind, spec)))
    tools = _tool_format(body)
    if tools.guided is not None:
        sources.append(("tool_choice", tools.guided))
    if len(sources) > 1:
        raise ServeError(400, f"{sources[1][0]}: only one of response_format, guided_json, "
                         "guided_regex, guided_choice, guided_grammar and tool calls may "
                         "constrain the output", param=sources[1][0].split(".")[0])
    for field, (kind, spec) in sources:
        if field != "tool_choice":  # checked tool by tool in _tool_format
            _check(kind, spec, field)
    if tools.tools is not None:
        return tools
    return OutputFormat(guided=sources[0][1] if sources else None)


def _tool_format(body) -> OutputFormat:
    tools: list[ToolDefinition] | None = getattr(body, "tools", None)
    choice = getattr(body, "tool_choice", None)
    if not tools:
        if choice not in (None, "none"):
            raise ServeError(400, "tool_choice: no tools given", param="tool_choice")
        return OutputFormat()
    choice = choice or "auto"
    if choice == "none":
        return OutputFormat()
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ServeError(400, "tools: two tools have the same name", param="tools")
    schemas = []
    for i, tool in enumerate(tools):
        params = tool.function.parameters
        field = f"tools.{i}.function.parameters"
        params_text = _schema_text(params if params is not None else {"type": "object"}, field)
        _check("json_schema", params_text, field)
        schemas.append(_call_schema(tool.function.name, json.loads(params_text)))
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ServeError(400, f"tool_choice: no tool is named {choice.function.name!r}",
                             param="tool_choice")
        schemas = [schemas[names.index(choice.function.name)]]
    parallel = getattr(body, "parallel_tool_calls", True) and not isinstance(choice, NamedToolChoice)
    grammar = _calls_grammar(schemas, parallel, allow_text=choice == "auto")
    _check("grammar", grammar, "tools")
    return OutputFormat(("grammar", grammar), [t.model_dump(exclude_none=True) for t in tools],
                        calls_only=choice != "auto")


def _call_schema(name: str, parameters: dict) -> dict:
    """One call's JSON: this tool's name and arguments valid for its parameters."""
    return {"x-guidance": _COMPACT, "type": "object",
            "properties": {"name": {"const": name}, "arguments": _closed(parameters)},
            "required": ["name", "arguments"], "additionalProperties": False}


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def _closed(schema):
    """``schema`` with every object schema that declares properties and leaves
    ``additionalProperties`` unsaid closed to undeclared keys (a copy; the request's
    own is left alone)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(v) for v in out[key]]
    for key in ("items", "additionalProperties", "not", "if", "then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    if isinstance(out.get("properties"), dict) and out["properties"] and "additionalProperties" not in out:
        out["additionalProperties"] = False  # an object with no declared keys stays free-form
    return out


def _calls_grammar(schemas: list[dict], parallel: bool, allow_text: bool) -> str:
    """A Lark grammar (llguidance's dialect): one ``%json`` rule per tool, so each
    schema's ``$ref`` resolves against its own root."""
    rules = [f"tool_{i}: %json {json.dumps(s)}" for i, s in enumerate(schemas)]
    call = f"call: {json.dumps(CALL_OPEN)} ({' | '.join(f'tool_{i}' for i in range(len(schemas)))}) " \
           f"{json.dumps(CALL_CLOSE)}"
    calls = 'calls: call ("\\n" call)* "\\n"?' if parallel else 'calls: call "\\n"?'
    start = "start: calls | TEXT" if allow_text else "start: calls"
    text = [f"TEXT: /(.|\\n)*/ & ~/{CALL_OPEN.strip()}(.|\\n)*/"] if allow_text else []
    return "\n".join([start, calls, call, *rules, *text])


def _schema_text(schema, field: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ServeError(400, f"{field}: not JSON ({exc})", param=field.split(".")[0]) from None
    if not isinstance(schema, dict):
        raise ServeError(400, f"{field}: a JSON Schema must be an object", param=field.split(".")[0])
    return json.dumps(schema)


def _check(kind: str, spec: str, field: str) -> None:
    try:
        check_grammar(kind, spec)
    except GrammarError as exc:
        raise ServeError(400, f"{field}: {exc}", param=field) from None


def template_messages(messages) -> list[dict]:
    """A chat's messages as chat templates read them (Hugging Face's keys): tool calls
    of earlier assistant turns, their arguments as objects (as vLLM passes them; text
    that is not JSON stays text), and the ids tool results answer."""
    out = []
    for m in messages:
        entry = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            entry["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            entry["name"] = m.name
        out.append(entry)
    return out


def _template_call(call: ToolCall) -> dict:
    entry = call.model_dump()
    with contextlib.suppress(json.JSONDecodeError):
        entry["function"]["arguments"] = json.loads(call.function.arguments)
    return entry


# -- the output ---------------------------------------------------------------------------

class ToolCallText:
    """Splits one choice's text into content and calls as it arrives. ``feed`` returns
    the text released as content and the calls completed; ``flush`` what is left."""

    def __init__(self, calls_only: bool) -> None:
        self._buffer = ""
        self._mode = "calls" if calls_only else "undecided"  # then "calls" or "text"
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._buffer += text
        if self._mode == "undecided":
            if self._buffer.startswith(CALL_OPEN):
                self._mode = "calls"
            elif CALL_OPEN.startswith(self._buffer):
                return "", []  # could still open a call
            else:
                self._mode = "text"
        if self._mode == "text":
            released, self._buffer = self._buffer, ""
            return released, []
        calls = []
        while (start := self._buffer.find(CALL_OPEN)) >= 0:
            end = self._buffer.find(CALL_CLOSE, start + len(CALL_OPEN))
            if end < 0:
                break
            call = self._call(self._buffer[start + len(CALL_OPEN):end])
            if call is None:  # not a call after all: leave it as text
                break
            calls.append(call)
            self._buffer = self._buffer[end + len(CALL_CLOSE):]
        return "", calls

    def flush(self) -> str:
        """The rest, as content: an unfinished call (cut by ``max_tokens``) or text still
        held back; the newline between calls is dropped."""
        rest, self._buffer = self._buffer, ""
        return rest.strip("\n") if self.num_calls else rest

    def _call(self, body: str) -> dict | None:
        try:
            parsed = json.loads(body)
            name, arguments = parsed["name"], parsed["arguments"]
        except (json.JSONDecodeError, KeyError, TypeError):
            return None
        self.num_calls += 1
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


class ToolCallShaper:
    """Serving's ``ResponseBuilder`` for a request that may call tools: the same bodies,
    with each choice's text split into content and ``tool_calls``. Everything else is
    the wrapped builder's (``__getattr__``). One per request, on the event loop."""

    def __init__(self, inner, calls_only: bool) -> None:
        self._inner = inner
        self._calls_only = calls_only
        self._texts: dict[int, ToolCallText] = {}  # by choice index

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def _text(self, index: int) -> ToolCallText:
        return self._texts.setdefault(index, ToolCallText(self._calls_only))

    def response(self, *args, **kwargs) -> dict:
        body = self._inner.response(*args, **kwargs)
        for choice in body["choices"]:
            message, text = choice["message"], ToolCallText(self._calls_only)
            content, calls = text.feed(message.get("content") or "")
            content += text.flush()
            if calls:
                message["content"] = content or None
                message["tool_calls"] = calls
                _tool_calls_finish(choice)
        return body

    def chunk(self, *args, **kwargs) -> dict | None:
        """The wrapped builder's chunk with its text split; None when it carries nothing
        (text held back inside a call, no ids, logprobs or finish): not sent."""
        body = self._inner.chunk(*args, **kwargs)
        is_empty = True
        for choice in body["choices"]:
            delta, text = choice.get("delta", {}), self._text(choice["index"])
            content, calls = text.feed(delta.pop("content", None) or "")
            if choice["finish_reason"] is not None:
                content += text.flush()
                if text.num_calls:
                    _tool_calls_finish(choice)
            if content or "role" in delta:
                delta["content"] = content
            if calls:
                first = text.num_calls - len(calls)
                delta["tool_calls"] = [{"index": first + i, **c} for i, c in enumerate(calls)]
            is_empty &= (not delta and choice["finish_reason"] is None and choice.get("logprobs") is None
                         and not choice.get("token_ids"))
        return None if is_empty else body


def _tool_calls_finish(choice: dict) -> None:
    if choice["finish_reason"] == "stop":  # the grammar ended: the calls are complete
        choice["finish_reason"] = "tool_calls"
