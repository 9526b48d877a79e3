"""What clients read besides completions: /tokenize and /detokenize, /v1/models'
``max_model_len``, a prompt plus ``max_tokens`` over the context is a 400 with the
numbers, usage's ``cached_tokens`` and ``continuous_usage_stats``."""

from __future__ import annotations

import httpx
import openai
import orjson

from tests.unit.coordinator.harness import serve

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def _stream_events(r: httpx.Response) -> list[dict]:
    return [orjson.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: {")]


def test_tokenize_and_detokenize_agree_with_the_prompts_the_coordinator_sends(loop, stubs):
    address = stubs(num_tokens=2, max_model_len=64)
    with serve(loop, [address]) as app:
        r = httpx.post(app.url + "/tokenize", json={"model": "tiny", "prompt": "héllo"}, timeout=10)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["count"] == len(out["tokens"]) == len("héllo".encode())
        assert out["max_model_len"] == 64
        back = httpx.post(app.url + "/detokenize", json={"tokens": out["tokens"]}, timeout=10)
        assert back.json() == {"prompt": "héllo"}
        # vLLM's add_special_tokens, as `vllm bench serve` sends it (this preset has no BOS)
        plain = httpx.post(app.url + "/tokenize", json={"prompt": "héllo", "add_special_tokens": False},
                           timeout=10)
        assert plain.status_code == 200, plain.text
        assert plain.json()["tokens"] == out["tokens"]
        # A completion's prompt is exactly what /tokenize counted.
        httpx.post(app.url + "/v1/completions", json={"model": "tiny", "prompt": "héllo",
                                                      "max_tokens": 2}, timeout=10)
        sent = stubs.by_address[address]
        chat = httpx.post(app.url + "/tokenize", json={**CHAT, "return_token_strs": True},
                          timeout=10).json()
        assert "".join(chat["token_strs"]).startswith("<|user|>\nhi\n")
        bad = [httpx.post(app.url + "/tokenize", json=b, timeout=10) for b in (
            {"prompt": "a", "messages": CHAT["messages"]}, {}, {"model": "other", "prompt": "a"},
            {"prompt": "a", "surprise": 1})]
        assert [b.status_code for b in bad] == [400, 400, 404, 400]
        assert httpx.post(app.url + "/detokenize", json={"tokens": [320]},
                          timeout=10).status_code == 400
    assert sent.request_ids  # the completion ran


def test_models_and_context_limit_use_the_engines_max_model_len(loop, stubs):
    with serve(loop, [stubs(num_tokens=2, max_model_len=32)]) as app:
        client = openai.OpenAI(base_url=app.url + "/v1", api_key="x")
        (card,) = client.models.list().data
        assert card.id == "tiny" and card.max_model_len == 32
        over = httpx.post(app.url + "/v1/completions", json={"model": "tiny", "prompt": "a" * 20,
                                                             "max_tokens": 13}, timeout=10)
        assert over.status_code == 400
        error = over.json()["error"]
        assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
        assert all(str(n) in error["message"] for n in (32, 20, 13, 33))
        long_prompt = httpx.post(app.url + "/v1/chat/completions",
                                 json={**CHAT, "messages": [{"role": "user", "content": "a" * 40}]},
                                 timeout=10)
        assert long_prompt.status_code == 400 and long_prompt.json()["error"]["param"] == "prompt"
        fits = httpx.post(app.url + "/v1/completions", json={"model": "tiny", "prompt": "a" * 20,
                                                             "max_tokens": 12}, timeout=10)
        assert fits.status_code == 200, fits.text
        chat = httpx.post(app.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert chat.status_code == 200  # no max_tokens: runs to the limit, never refused


def test_usage_reports_cached_tokens_of_the_prefill_and_continuous_stats(loop, stubs):
    p = stubs(role="prefill", num_cached_tokens=16)
    # D waits before each token as a real one waits for P's KV: P's message, which carries
    # the prompt's cached tokens, comes first (on its own stream, it could otherwise be
    # read after D's whole answer)
    d = stubs(role="decode", num_tokens=3, num_cached_tokens=0, token_delay_s=0.05)
    with serve(loop, [p, d]) as app:
        client = openai.OpenAI(base_url=app.url + "/v1", api_key="x")
        out = client.completions.create(model="tiny", prompt="hello world", max_tokens=3)
        assert out.usage.prompt_tokens_details.cached_tokens == 16
        r = httpx.post(app.url + "/v1/completions", timeout=10, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        events = _stream_events(r)
        with_text = [e for e in events if e["choices"] and e["choices"][0]["text"]]
        assert [e["usage"]["completion_tokens"] for e in with_text] == [1, 2, 3]
        assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 5 + 3
        assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
        plain = httpx.post(app.url + "/v1/completions", timeout=10, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 3, "stream": True})
        assert all("usage" not in e for e in _stream_events(plain))
