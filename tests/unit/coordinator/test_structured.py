"""Structured output and tools at the REST edge: which constraint a body asks for (a
malformed one is a 400 naming its field), the tool-call grammar a matcher enforces,
and a tool-enabled output split into content and OpenAI tool_calls, whole or streamed."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pdserve.coordinator.errors import ServeError
from pdserve.coordinator.prompts import PromptBuilder
from pdserve.coordinator.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    ResponseBuilder,
)
from pdserve.coordinator.structured import (
    CALL_CLOSE,
    CALL_OPEN,
    ToolCallText,
    output_format,
    template_messages,
)
from pdserve.engine.guided import Grammars, GuidedError
from pdserve.runtime.tokenizer import ByteTokenizer
from tests.unit.coordinator.harness import serve

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _chat(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(**CHAT, **extra)


def _call(name: str, arguments: dict) -> str:
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{CALL_CLOSE}"


@pytest.fixture(scope="module")
def grammars():
    return Grammars(ByteTokenizer(320), 320, (257,))


def _accepts(grammars, guided, text: str, complete: bool = True) -> bool:
    """Whether the engine's matcher for ``guided`` takes ``text`` (and, with
    ``complete``, may end after it)."""
    try:
        matcher = grammars.start(*guided, list(text.encode()))
    except GuidedError:
        return False
    return not complete or matcher.is_done or bool(matcher.bitmask()[257 // 8] >> (257 % 8) & 1)


def test_each_source_becomes_its_wire_constraint():
    assert output_format(_chat()).guided is None
    assert output_format(_chat(response_format={"type": "text"})).guided is None
    assert output_format(_chat(response_format={"type": "json_object"})).guided == ("json_object", "")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = output_format(_chat(response_format={"type": "json_schema", "json_schema": {
        "name": "thing", "schema": schema, "strict": True}}))
    assert fmt.guided == ("json_schema", json.dumps(schema)) and fmt.tools is None
    body = CompletionRequest(model="tiny", prompt="x", guided_choice=["yes", "no"])
    assert output_format(body).guided == ("choice", '["yes", "no"]')
    assert output_format(CompletionRequest(model="tiny", prompt="x", guided_regex="[0-9]+")).guided \
        == ("regex", "[0-9]+")
    assert output_format(_chat(guided_json=json.dumps(schema))).guided == ("json_schema", json.dumps(schema))


def test_a_body_without_constraints_is_unconstrained_whatever_its_fields():
    """Completions have no tool fields, chats have them unset; an object that is not a
    request model is read with defaults."""
    class Bare:
        guided_regex = None

    for body in (CompletionRequest(model="tiny", prompt="x"), _chat(), Bare()):
        fmt = output_format(body)
        assert (fmt.guided, fmt.tools, fmt.wrap("shape")) == (None, None, "shape")
    assert output_format(_chat(tool_choice="none")).guided is None

    class Choosy(Bare):
        guided_regex = "[0-9]+"

    assert output_format(Choosy()).guided == ("regex", "[0-9]+")


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [TIME, {"type": "function", "function": {
        "name": "bad", "parameters": {"type": "object", "properties": {"a": {"type": 3}}}}}]},
     "tools.1.function.parameters"),
])
def test_a_malformed_constraint_is_a_400_naming_its_field(extra, param):
    with pytest.raises(ServeError) as info:
        output_format(_chat(**extra))
    assert info.value.status == 400 and info.value.param == param


def test_tool_choices_constrain_the_output_as_documented(grammars):
    weather = _call("get_weather", {"city": "Paris"})
    both = _call("get_time", {}) + "\n" + weather
    required = output_format(_chat(tools=[WEATHER, TIME], tool_choice="required"))
    assert required.calls_only and [t["function"]["name"] for t in required.tools] == [
        "get_weather", "get_time"]
    assert _accepts(grammars, required.guided, weather.replace(" ", ""))
    assert _accepts(grammars, required.guided, both.replace(" ", ""))
    assert not _accepts(grammars, required.guided, "Sunny.")
    assert not _accepts(grammars, required.guided, _call("get_weather", {"town": "x"}).replace(" ", ""))
    assert not _accepts(grammars, required.guided, _call("launch", {}).replace(" ", ""))
    single = output_format(_chat(tools=[WEATHER, TIME], tool_choice="required",
                                 parallel_tool_calls=False))
    assert not _accepts(grammars, single.guided, both.replace(" ", ""))
    named = output_format(_chat(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_time"}}))
    assert _accepts(grammars, named.guided, _call("get_time", {}).replace(" ", ""))
    assert not _accepts(grammars, named.guided, weather.replace(" ", ""))
    auto = output_format(_chat(tools=[WEATHER]))  # auto is the default with tools
    assert not auto.calls_only
    assert _accepts(grammars, auto.guided, "Sunny, 20 degrees.")
    assert _accepts(grammars, auto.guided, weather.replace(" ", ""))
    assert not _accepts(grammars, auto.guided, CALL_OPEN + '{"name":"get_weather","arguments":{}}',
                        complete=False)
    none = output_format(_chat(tools=[WEATHER], tool_choice="none"))
    assert none.guided is None and none.tools is None


@pytest.mark.parametrize("calls_only", [False, True])
def test_tool_call_text_splits_calls_however_the_text_arrives(calls_only):
    text = _call("get_weather", {"city": "Paris"}) + "\n" + _call("get_time", {})
    for step in (1, 3, 7, len(text)):
        split = ToolCallText(calls_only)
        calls, content = [], ""
        for i in range(0, len(text), step):
            released, new = split.feed(text[i:i + step])
            content += released
            calls += new
        content += split.flush()
        assert content == ""
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {})]
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


def test_auto_text_is_released_once_it_cannot_be_a_call():
    split = ToolCallText(calls_only=False)
    assert split.feed("<tool") == ("", [])
    assert split.feed("s are") == ("<tools are", [])
    assert split.feed(" fun") == (" fun", [])
    cut = ToolCallText(calls_only=False)
    assert cut.feed(CALL_OPEN + '{"name":"get_') == ("", [])
    assert cut.flush() == CALL_OPEN + '{"name":"get_'  # cut by max_tokens: left as text


def test_the_shaper_writes_tool_calls_and_their_finish_reason():
    fmt = output_format(_chat(tools=[WEATHER], tool_choice="required"))
    shape = fmt.wrap(ResponseBuilder("cmpl-1", "tiny", 1, is_chat=True))
    text = _call("get_weather", {"city": "Oslo"})
    body = shape.response(text, "stop", {"prompt_tokens": 1, "completion_tokens": 2,
                                          "total_tokens": 3})
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    chunks = [shape.chunk(text[:10], is_first=True), shape.chunk(text[10:]),
              shape.chunk("", finish_reason="stop")]
    # The documented shapes, ours and the SDK's.
    assert ChatCompletionResponse.model_validate(body).model_dump(exclude_unset=True) == body
    ChatCompletion.model_validate(body)
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1]["tool_calls"][0]["index"] == 0 and "content" not in deltas[1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    plain = output_format(_chat(tools=[WEATHER])).wrap(ResponseBuilder("c", "tiny", 1, True))
    body = plain.response("Hello", "stop", {})
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert body["choices"][0]["finish_reason"] == "stop"


def test_tool_calls_through_the_openai_client(loop, stubs):
    """A stub engine that "generates" a call: the SDK parses it, whole and streamed; a
    malformed schema is a 400 before any engine sees the request."""
    text = _call("get_weather", {"city": "Paris"}).replace(" ", "")
    stub = stubs(token_ids=list(text.encode()), num_tokens=len(text))
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with serve(loop, [stub], local_prefill_max_tokens=1 << 20) as app:
        client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
        done = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                              tool_choice="required", max_tokens=len(text))
        call = done.choices[0].message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                             {"city": "Paris"})
        stream = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                                tool_choice="required", max_tokens=len(text),
                                                stream=True)
        streamed = [tc for chunk in stream for tc in (chunk.choices[0].delta.tool_calls or [])]
        assert [(tc.index, tc.function.name) for tc in streamed] == [(0, "get_weather")]
        bad = httpx.post(app.url + "/v1/chat/completions", timeout=10, json={
            **CHAT, "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "required": 3}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format.json_schema.schema"
    assert len(stubs.by_address[stub].request_ids) == 2


def test_the_template_gets_the_tools_and_earlier_calls():
    body = ChatCompletionRequest(model="tiny", tools=[WEATHER], messages=[
        {"role": "user", "content": "and Rome?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    messages = template_messages(body.messages)
    assert messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert messages[2]["tool_call_id"] == "call_1"
    text = PromptBuilder("tiny").render_chat(messages, output_format(body).tools)
    assert '{"name": "get_weather", "parameters": {"type": "object"' in text
    assert CALL_OPEN + '{"name": "get_weather", "arguments": {"city": "Rome"}}' + CALL_CLOSE in text
    assert text.endswith("<|tool|>\nsunny\n<|assistant|>\n")


def test_a_newline_after_a_call_may_end_the_output_and_does_not_commit_to_another(grammars):
    weather = _call("get_weather", {"city": "Paris"}).replace(" ", "")
    for parallel in (True, False):
        fmt = output_format(_chat(tools=[WEATHER, TIME], tool_choice="required",
                                  parallel_tool_calls=parallel))
        assert _accepts(grammars, fmt.guided, weather + "\n")  # then the end token
        assert not _accepts(grammars, fmt.guided, weather + "\n\n")
    split = ToolCallText(calls_only=True)
    assert [c["function"]["name"] for c in split.feed(weather + "\n")[1]] == ["get_weather"]
    assert split.flush() == ""


def test_declared_parameters_take_no_other_keys_unless_the_schema_allows_them(grammars):
    open_weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "where": {
            "type": "object", "properties": {"lat": {"type": "number"}}}}, "required": ["city"]}}}
    fmt = output_format(_chat(tools=[open_weather], tool_choice="required"))
    assert _accepts(grammars, fmt.guided, _call("get_weather", {"city": "Paris"}).replace(" ", ""))
    assert not _accepts(grammars, fmt.guided,
                        _call("get_weather", {"city": "Paris", "junk": 1}).replace(" ", ""))
    assert not _accepts(grammars, fmt.guided,
                        _call("get_weather", {"city": "P", "where": {"x": 1}}).replace(" ", ""))
    assert "additionalProperties" not in open_weather["function"]["parameters"]  # left alone
    free = {"type": "function", "function": {"name": "log", "parameters": {
        "type": "object", "properties": {"fields": {"type": "object"}}}}}
    fmt = output_format(_chat(tools=[free], tool_choice="required"))
    assert _accepts(grammars, fmt.guided, _call("log", {"fields": {"any": 1}}).replace(" ", ""))
    allowed = {"type": "function", "function": {"name": "log", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}}}
    fmt = output_format(_chat(tools=[allowed], tool_choice="required"))
    assert _accepts(grammars, fmt.guided, _call("log", {"a": "x", "b": 2}).replace(" ", ""))
