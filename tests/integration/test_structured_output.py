"""Structured output and tool calls with the official ``openai`` client, through a PD
cluster (P + D, TCP KV transport) and a hybrid one (one engine) of real engine
processes running the random tiny model: the grammar makes its output valid, and
greedy (or seeded) output is the same whichever cluster, streamed or not, and when a
decode engine dies mid-stream (the last test kills one, so it runs last)."""

from __future__ import annotations

import json
import re
import signal

import jsonschema
import openai
import pytest

from pdserve.coordinator.app import create_app
from pdserve.coordinator.settings import CoordinatorSettings
from tests.procs import PDSERVE, Proc
from tests.unit.coordinator.harness import ALWAYS_PD, AppServer, LoopThread

ENGINE_ARGS = ["--model", "tiny", "--port", "0", "--kv-transport", "tcp", "--num-kv-blocks", "256",
               "--block-size", "8", "--threads", "1"]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "pet": {"enum": ["cat", "dog", "none"]}},
    "required": ["name", "age", "pet"], "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 10},
                                  "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def cluster_apps():
    """name -> Coordinator app: "pd" (P, D1, D2, always disaggregated) and "hybrid"; and
    the engine processes by name."""
    names = {"P": "prefill", "D1": "decode", "D2": "decode", "H": "hybrid"}
    procs = {n: Proc([*PDSERVE, "engine", *ENGINE_ARGS, "--role", r]) for n, r in names.items()}
    loop = LoopThread()
    apps = []
    try:
        addrs = {n: p.wait_for(r"serving model .* on (\S+:\d+)", 120).group(1)
                 for n, p in procs.items()}
        for engines in (("P", "D1", "D2"), ("H",)):
            settings = CoordinatorSettings(engines=tuple(addrs[n] for n in engines), block_size=8,
                                           poll_interval_s=0.2, **ALWAYS_PD)
            apps.append(AppServer(loop, create_app(settings)).__enter__())
        yield {"pd": apps[0], "hybrid": apps[1]}, procs, addrs
    finally:
        for app in apps:
            app.__exit__(None, None, None)
        loop.close()
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def clusters(cluster_apps):
    """name -> Coordinator URL."""
    return {name: app.url for name, app in cluster_apps[0].items()}


def _clients(clusters) -> dict[str, openai.OpenAI]:
    return {name: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            for name, url in clusters.items()}


def _chat_both_ways(client: openai.OpenAI, **kwargs):
    """(the whole response's choice, the stream's content, tool calls and finish reason)."""
    done = client.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True,
                                                **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            calls[tc.index] = (tc.function.name, tc.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    return done.choices[0], (content, [calls[i] for i in sorted(calls)], finish)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 17)])
def test_json_schema_output_validates_and_is_the_same_on_pd_and_hybrid(clusters, temperature, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    texts = {}
    for name, client in _clients(clusters).items():
        choice, (streamed, _, finish) = _chat_both_ways(
            client, response_format=fmt, max_tokens=120, temperature=temperature, seed=seed)
        assert choice.finish_reason == finish == "stop"
        assert streamed == choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        texts[name] = choice.message.content
    assert texts["pd"] == texts["hybrid"]


def test_json_object_and_guided_extensions_on_completions(clusters):
    outputs = {}
    for name, client in _clients(clusters).items():
        obj = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=200, temperature=0,
            response_format={"type": "json_object"})
        regex = client.completions.create(model="tiny", prompt="Order number: ", max_tokens=30,
                                          temperature=0.9, seed=3,
                                          extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{4}"})
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", regex.choices[0].text)
        assert regex.choices[0].finish_reason == "stop"
        choice = client.completions.create(model="tiny", prompt="Answer: ", max_tokens=30,
                                           temperature=0, stream=True,
                                           extra_body={"guided_choice": ["yes", "no", "later"]})
        picked = "".join(c.choices[0].text for c in choice)
        assert picked in ("yes", "no", "later")
        if obj.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(obj.choices[0].message.content), dict)
        else:  # a random model may still be inside its object at max_tokens
            assert obj.choices[0].message.content.startswith("{")
        outputs[name] = (obj.choices[0].message.content, regex.choices[0].text, picked)
    assert outputs["pd"] == outputs["hybrid"]


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_calls_are_valid_calls_streamed_or_not(clusters, tool_choice):
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    results = {}
    for name, client in _clients(clusters).items():
        choice, (content, streamed, finish) = _chat_both_ways(
            client, tools=[WEATHER, TIME], tool_choice=tool_choice, parallel_tool_calls=False,
            max_tokens=120, temperature=0)
        assert choice.finish_reason == finish == "tool_calls"
        assert choice.message.content is None and content == ""
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert calls == streamed and len(calls) == 1
        assert all(c.type == "function" and c.id.startswith("call_")
                   for c in choice.message.tool_calls)
        tool, arguments = calls[0]
        if isinstance(tool_choice, dict):
            assert tool == "get_time"
        jsonschema.validate(json.loads(arguments), parameters[tool])
        results[name] = calls
    assert results["pd"] == results["hybrid"]


def test_auto_answers_text_or_a_valid_call_and_bad_tools_are_a_400(clusters):
    results = {}
    for name, client in _clients(clusters).items():
        choice, (content, streamed, finish) = _chat_both_ways(
            client, tools=[WEATHER], max_tokens=40, temperature=0)
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
        else:
            assert not choice.message.content.startswith("<tool_call>")
            assert content == choice.message.content and finish == choice.finish_reason
        results[name] = (choice.message.content, streamed)
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "strange"}}}])
        assert info.value.body["param"] == "tools.0.function.parameters"
    assert results["pd"] == results["hybrid"]


def test_a_decode_killed_mid_stream_continues_under_the_same_grammar(cluster_apps):
    """The continuation's engines replay the streamed tokens into their matchers: the
    output is the uninterrupted one (the hybrid cluster's), and still matches."""
    apps, procs, addrs = cluster_apps
    pattern = "[a-z]{600}"
    kwargs = dict(model="tiny", prompt="Letters, please: ", max_tokens=700, temperature=0,
                  extra_body={"guided_regex": pattern})
    hybrid = openai.OpenAI(base_url=apps["hybrid"].url + "/v1", api_key="unused", max_retries=0)
    want = hybrid.completions.create(**kwargs).choices[0].text
    pd = openai.OpenAI(base_url=apps["pd"].url + "/v1", api_key="unused", max_retries=0)
    text, killed, finish = "", None, None
    for chunk in pd.completions.create(stream=True, **kwargs):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
        if killed is None and text:
            for name in ("D1", "D2"):
                if apps["pd"].deps.registry.get(addrs[name]).num_inflight:
                    procs[name].signal(signal.SIGKILL)
                    killed, num_before = name, len(text)
                    break
            assert killed, "no decode engine was running the request"
    assert text == want and re.fullmatch(pattern, text) and finish == "stop"
    assert num_before < len(want)
    assert apps["pd"].deps.metrics.registry.get_sample_value(
        "pdserve_coordinator_continuations_total") == 1
