"""A list of prompts in one completion request, as vLLM and OpenAI take it (and as
lm-eval's ``local-completions`` sends even one prompt): each prompt answered with its
``n`` choices, indexed prompt by prompt, usage summed; malformed prompts are 400s that
say which form was meant."""

from __future__ import annotations

import httpx
import pytest

from tests.unit.coordinator.harness import serve


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


def test_a_list_of_prompts_is_not_streamed_and_too_many_stops_say_so(loop, stubs):
    with serve(loop, [stubs(num_tokens=1)]) as app:
        r = post(app, prompt=["a", "b"], stream=True)
        assert r.status_code == 400 and "cannot be streamed" in r.json()["error"]["message"]
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
