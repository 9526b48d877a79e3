"""The OpenAI API is honest about its parameters: every sampling control reaches the
engine's request, a parameter pdserve does not implement is a 400 naming it (its
defaults pass), and a chat without ``max_tokens`` runs to the context limit."""

from __future__ import annotations

import httpx
import pytest

from pdserve.coordinator.lifecycle import engine_request
from pdserve.coordinator.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.coordinator.serving import UNTIL_CONTEXT_LIMIT, build_generation_params
from pdserve.coordinator.settings import CoordinatorSettings
from tests.unit.coordinator.harness import serve

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny", "prompt": "hi"}


def test_sampling_controls_reach_the_engine_request():
    body = CompletionRequest(**COMPLETION, top_k=40, min_p=0.1, presence_penalty=0.5,
                             frequency_penalty=-0.25, repetition_penalty=1.2,
                             logit_bias={"65": -100, "7": 2.5}, stop_token_ids=[9, 10],
                             temperature=0)
    sampling = engine_request(build_generation_params(body, CoordinatorSettings(), 320),
                              "r1.2", [1, 2, 3, 4], 2).sampling
    assert (sampling.top_k, sampling.presence_penalty, sampling.frequency_penalty,
            dict(sampling.logit_bias), list(sampling.stop_token_ids), sampling.sample_offset) == (
        40, 0.5, -0.25, {65: -100.0, 7: 2.5}, [9, 10], 2)
    assert sampling.min_p == pytest.approx(0.1) and sampling.repetition_penalty == pytest.approx(1.2)
    off = build_generation_params(CompletionRequest(**COMPLETION), CoordinatorSettings())
    assert engine_request(off, "r1", [1], 0).sampling.top_k == 0  # vLLM's -1: off


def test_chat_without_max_tokens_runs_to_the_context_limit():
    settings = CoordinatorSettings()
    chat = build_generation_params(ChatCompletionRequest(**CHAT), settings)
    assert chat.max_tokens == UNTIL_CONTEXT_LIMIT
    assert build_generation_params(CompletionRequest(**COMPLETION), settings).max_tokens == 16
    given = ChatCompletionRequest(**CHAT, max_completion_tokens=5)
    assert build_generation_params(given, settings).max_tokens == 5


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"n": 99}, "n"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nonsense"}}}]}, "tools.0.function.parameters"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/completions", {"logit_bias": {"999": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/completions", {"stop_token_ids": [320]}, "stop_token_ids"),
])
def test_unsupported_parameters_are_a_400_naming_them(loop, stubs, path, extra, param):
    body = {**(CHAT if path.endswith("chat/completions") else COMPLETION), **extra}
    with serve(loop, [stubs(num_tokens=2)]) as app:
        r = httpx.post(app.url + path, json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"n": 1, "logprobs": None, "echo": False, "best_of": 1, "user": "u",
                         "some_future_field": {"x": 1}}),
    ("/v1/chat/completions", {"n": 1, "logprobs": False, "top_logprobs": 0,
                              "response_format": {"type": "text"}, "tools": [],
                              "store": True, "metadata": {"a": "b"}}),
])
def test_harmless_defaults_and_unknown_fields_pass(loop, stubs, path, extra):
    body = {**(CHAT if path.endswith("chat/completions") else COMPLETION), **extra,
            "max_tokens": 2}
    with serve(loop, [stubs(num_tokens=2)]) as app:
        r = httpx.post(app.url + path, json=body, timeout=10)
    assert r.status_code == 200, r.text
