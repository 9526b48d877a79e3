"""The client's reading of SSE streams, against canned server answers (httpx MockTransport)."""

from __future__ import annotations

import asyncio
import json

import httpx

from pdserve.bench.client import CompletionClient, api_base
from pdserve.bench.prompts import PlannedRequest

REQUEST = PlannedRequest("chat", [1, 2, 3], max_tokens=3, num_prompt_tokens=3)


def sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
                    for e in events)


def chunk(text: str = "", token_ids: list[int] | None = None, **extra) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"object": "text_completion", "choices": [choice], **extra}


def complete(body: bytes, status: int = 200, seen: list | None = None):
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(json.loads(request.content))
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    async def go():
        async with CompletionClient("http://server", model="m",
                                    transport=httpx.MockTransport(handler)) as client:
            return await client.complete(REQUEST)

    return asyncio.run(go())


def test_a_stream_with_token_ids_and_usage():
    seen: list[dict] = []
    body = sse(chunk("", [5]), chunk("ab", [6, 7]), {"choices": [{"index": 0, "text": "",
               "finish_reason": "length"}]},
               {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}, b"[DONE]")
    r = complete(body, seen=seen)
    assert r.is_ok and r.chunk_tokens == [1, 2] and r.has_exact_tokens
    assert r.output_tokens == 3 and r.prompt_tokens == 3
    assert len(r.itls_s()) == 2  # the second chunk's two tokens share its gap
    (sent,) = seen
    assert sent["max_tokens"] == sent["min_tokens"] == 3 and sent["ignore_eos"] is True
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["prompt"] == [1, 2, 3] and sent["model"] == "m"


def test_text_only_chunks_count_one_each_and_usage_gives_the_total():
    body = sse(chunk("a"), chunk("b"), {"choices": [], "usage": {"completion_tokens": 3}}, b"[DONE]")
    r = complete(body)
    assert r.is_ok and r.chunk_tokens == [1, 1] and not r.has_exact_tokens
    assert r.output_tokens == 3


def test_failures_are_results_not_exceptions():
    assert complete(b'{"error": {"message": "busy"}}', status=503).error == "503"
    mid = complete(sse(chunk("a", [1]), {"error": {"message": "engine died"}}, b"[DONE]"))
    assert mid.error == "stream_error" and "engine died" in mid.error_detail
    assert complete(sse(b"{not json")).error == "bad_stream"
    assert complete(sse({"choices": "nope"})).error == "bad_stream"
    assert complete(sse(b"[DONE]")).error == "no_tokens"


def test_api_base_accepts_either_form():
    assert api_base("http://h:1") == api_base("http://h:1/v1/") == "http://h:1/v1"
