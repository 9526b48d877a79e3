"""Input the Coordinator cannot use is a 400 naming the field, and output that line
splitters would cut is escaped: invalid Unicode in any text of a request, and
U+2028, U+2029 and U+0085 in SSE payloads."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.unit.coordinator.harness import serve

SURROGATE = "\\ud800"  # a lone surrogate, as JSON can carry it


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", f'{{"model": "tiny", "prompt": "a{SURROGATE}b"}}', "prompt"),
    ("/v1/completions", f'{{"model": "tiny", "prompt": "x", "stop": "{SURROGATE}"}}', "stop"),
    ("/v1/completions", f'{{"model": "tiny", "prompt": "x", "stop": ["ok", "{SURROGATE}"]}}', "stop"),
    ("/v1/chat/completions",
     f'{{"model": "tiny", "messages": [{{"role": "user", "content": "a{SURROGATE}"}}]}}',
     "messages.0.content"),
    ("/v1/chat/completions",
     f'{{"model": "tiny", "messages": [{{"role": "user", "content": [{{"type": "text", '
     f'"text": "{SURROGATE}"}}]}}]}}', "messages.0.content"),
    ("/v1/chat/completions",
     f'{{"model": "tiny", "messages": [{{"role": "user", "content": "hi", "name": "{SURROGATE}"}}]}}',
     "messages.0.name"),
    ("/v1/chat/completions",
     f'{{"model": "tiny", "messages": [{{"role": "user", "content": "hi"}}], "stop": "{SURROGATE}"}}',
     "stop"),
])
def test_invalid_unicode_is_a_400_naming_the_field(loop, stubs, path, body, param):
    with serve(loop, [stubs(num_tokens=2)]) as app:
        r = httpx.post(app.url + path, content=body.encode(), timeout=10,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


def test_sse_payloads_escape_the_line_breaks_json_allows(loop, stubs):
    text = "\u2028A\u0085B\u2029"
    token_ids = list(text.encode())  # the tiny model's tokens are bytes
    engine = stubs(num_tokens=len(token_ids), token_ids=token_ids)
    with serve(loop, [engine]) as app:
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
            r = httpx.post(app.url + path, timeout=10,
                           json={"model": "tiny", "max_tokens": len(token_ids), "stream": True, **body})
            assert r.status_code == 200
            # A splitter that also breaks at U+2028, U+2029 and U+0085 sees whole events.
            events = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
            assert events[-1] == "[DONE]"
            chunks = [orjson.loads(e) for e in events[:-1]]
            choices = [c["choices"][0] for c in chunks]
            got = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices)
            assert got == text
