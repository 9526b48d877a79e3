"""A list of prompts in one completion request, as vLLM and OpenAI take it (and as
lm-eval's ``local-completions`` sends even one prompt): each prompt answered with its
``n`` choices, indexed prompt by prompt, usage summed, whole or streamed; malformed
prompts are 400s that say which form was meant."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest

from tests.unit.coordinator.harness import serve
from tests.unit.coordinator.test_quiet_logs import wait_for


def post(app, **body) -> httpx.Response:
    return httpx.post(app.url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "max_tokens": 3, **body})


def test_a_list_of_prompts_is_answered_prompt_by_prompt(loop, stubs):
    engines = [stubs(num_tokens=3, token_ids=[65, 66, 67])]
    with serve(loop, engines) as app:
        single = post(app, prompt="hello").json()
        r = post(app, prompt=["hello", [104, 105], "hey"], n=2)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3, 4, 5]
        assert all(c["text"] == "ABC" for c in body["choices"])
        usage = body["usage"]
        assert usage["prompt_tokens"] == len("hello") + 2 + len("hey")
        assert usage["completion_tokens"] == 18 and usage["total_tokens"] == 18 + usage["prompt_tokens"]
        # lm-eval's shape: one prompt of token ids in a list, the same answer as without it.
        one = post(app, prompt=[[104, 101, 108, 108, 111]], logprobs=1, echo=False).json()
        assert [c["index"] for c in one["choices"]] == [0]
        assert one["choices"][0]["text"] == single["choices"][0]["text"]
        assert one["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]


@pytest.mark.parametrize(("prompt", "message"), [
    ([["a"]], "prompt 0 must be a non-empty string or list of token ids"),
    ([1, "a"], "a prompt is a string, a list of token ids, or a list of prompts"),
    ([], "a prompt is a string, a list of token ids, or a list of prompts"),
    ({"text": "hi"}, "a prompt is a string, a list of token ids, or a list of prompts"),
    ([[1, -2]], "prompt 0: token ids must be non-negative"),
    (["ok", ""], "prompt 1 is empty"),
    (["x"] * 257, "at most 256 prompts in one request"),
    ("", "the prompt is empty"),
])
def test_a_malformed_prompt_says_which_form_was_meant(loop, stubs, prompt, message):
    with serve(loop, [stubs(num_tokens=1)]) as app:
        r = post(app, prompt=prompt)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == "prompt", error
    assert "valid string" not in error["message"]


def stream_events(app, **body) -> list:
    with httpx.stream("POST", app.url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "max_tokens": 3, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        return [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]


def test_a_streamed_list_of_prompts_streams_every_choice_of_every_prompt(loop, stubs):
    """As vLLM streams it: one stream, one id, each prompt's choices at ``i * n`` on,
    one usage chunk summing every prompt's (as the whole answer's), then [DONE]."""
    engines = [stubs(num_tokens=3, token_ids=[65, 66, 67], token_delay_s=0.01)]
    body = {"prompt": ["hello", "hey", [104, 105]], "n": 2, "echo": True}
    with serve(loop, engines) as app:
        whole = post(app, **body).json()
        events = stream_events(app, **body, stream_options={"include_usage": True})
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        texts = defaultdict(str)
        for chunk in chunks[:-1]:
            for choice in chunk["choices"]:
                texts[choice["index"]] += choice["text"]
        assert dict(texts) == {c["index"]: c["text"] for c in whole["choices"]}
        assert dict(texts) == {0: "helloABC", 1: "helloABC", 2: "heyABC", 3: "heyABC",
                               4: "hiABC", 5: "hiABC"}
        assert len({c["id"] for c in chunks}) == 1
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
        finished = [c for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
        assert sorted(c["index"] for c in finished) == list(range(6))
        # Without include_usage no usage chunk; every prompt's slot is released.
        events = stream_events(app, prompt=["a", "b"])
        assert events[-1] == "[DONE]" and all(json.loads(e)["choices"] for e in events[:-1])
        wait_for(lambda: app.app.state.admission.num_running == 0)


def test_a_client_that_leaves_a_streamed_list_ends_every_prompt(loop, stubs):
    engine = stubs(num_tokens=100, token_delay_s=0.1)
    with serve(loop, [engine]) as app:
        with httpx.stream("POST", app.url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 100, "stream": True}) as r:
            assert r.status_code == 200
            assert len([line for _, line in zip(range(3), r.iter_lines(), strict=False)]) == 3
        wait_for(lambda: len(stubs.by_address[engine].aborted) == 3)  # every prompt's leg
        wait_for(lambda: app.app.state.admission.num_running == 0)


def test_too_many_stops_say_so(loop, stubs):
    with serve(loop, [stubs(num_tokens=1)]) as app:
        r = post(app, prompt="a", stop=["1", "2", "3", "4", "5"])
        assert r.status_code == 400 and "at most 4 stop sequences, got 5" in r.json()["error"]["message"]


@pytest.mark.parametrize(("content", "message"), [
    ([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
     "part 0 has type 'image_url': this model takes text only"),
    ([{"type": "text", "text": "hi"}, {"type": "input_audio"}], "part 1 has type 'input_audio'"),
    (42, "content must be a string or a list of parts of type 'text'"),
])
def test_a_non_text_content_part_says_so(loop, stubs, content, message):
    with serve(loop, [stubs(num_tokens=1)]) as app:
        r = httpx.post(app.url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == "messages.0.content", error
