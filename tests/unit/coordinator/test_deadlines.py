"""A request's deadlines: the first token's, the idle gap's between tokens, and the
total a client (or the settings) may set. A stream longer than every timeout runs to
its end as long as its tokens keep coming; a stall, a late first token or a passed
total ends it with 504 ``deadline``, its legs aborted on their engines."""

from __future__ import annotations

import math
import time

import httpx
import orjson
import pytest

from pdserve.coordinator.deadlines import Deadlines, client_total_s
from pdserve.coordinator.errors import ServeError
from pdserve.coordinator.settings import CoordinatorSettings
from tests.unit.coordinator.harness import BODY, metric, serve
from tests.unit.coordinator.test_output_loop import events
from tests.unit.coordinator.test_quiet_logs import wait_for

# Small bounds and a token cadence well inside them, so a whole stream outlasts both.
QUICK = {"first_token_timeout_s": 0.8, "token_idle_timeout_s": 0.8}
STEADY = {"num_tokens": 12, "token_delay_s": 0.2}  # 2.4 s in all


def post(app, stream: bool = False, headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(app.url + "/v1/completions", timeout=30, headers=headers,
                      json={**BODY, "max_tokens": 32, "stream": stream, **body})


def streamed(r: httpx.Response) -> tuple[str, list[dict]]:
    """(the text, the events after it: the last chunk or an error, as dicts)."""
    chunks = [orjson.loads(e) for e in events(r.content) if e != "[DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    return text, chunks


def pd(stubs, prefill_delay_s: float = 0.0, **decode) -> tuple[list[str], str]:
    """A stub P and D; the first token of an attempt is P's when P's message of it comes
    first (``prefill_delay_s`` makes it late), else D's."""
    d = stubs(role="decode", **decode)
    return [stubs(role="prefill", prefill_delay_s=prefill_delay_s), d], d


# -- the bounds, as arithmetic --

def test_the_deadlines_follow_the_stream():
    d = Deadlines.at_arrival(100.0, CoordinatorSettings(**QUICK))
    assert (d.first_token_s, d.end_s) == (100.8, math.inf)
    assert d.next_token_s(None) == 100.8 and d.next_token_s(500.0) == 500.8  # moved by each token
    capped = Deadlines.at_arrival(100.0, CoordinatorSettings(**QUICK, request_timeout_s=30),
                                  client_total_s=2.0)
    assert (capped.end_s, capped.next_token_s(101.5)) == (102.0, 102.0)  # the smaller total caps
    assert Deadlines.at_arrival(100.0, CoordinatorSettings(request_timeout_s=0.5)).first_token_s == 100.5
    assert "first-token timeout" in d.passed(None).message
    assert "token idle timeout" in d.passed(101.0).message
    assert "timeout of 2s" in capped.passed(101.5).message


def test_the_clients_total_is_the_smaller_of_its_header_and_its_body():
    assert client_total_s(None, None) is None
    assert client_total_s(b"2.5", None) == 2.5 and client_total_s(b"2.5", 1.5) == 1.5
    assert client_total_s(None, 7.0) == 7.0
    for bad in (b"abc", b"0", b"-1", b"0.5", b"inf", b"nan", b""):
        with pytest.raises(ServeError) as info:
            client_total_s(bad, None)
        assert (info.value.status, info.value.param) == (400, "x-request-timeout")


# -- over HTTP, on stub engines --

@pytest.mark.parametrize("stream", [True, False])
def test_a_stream_longer_than_every_timeout_runs_to_its_end(loop, stubs, stream):
    engines, _ = pd(stubs, **STEADY)
    with serve(loop, engines, **QUICK) as app:
        started = time.monotonic()
        r = post(app, stream=stream)
        assert time.monotonic() - started > 2 * QUICK["first_token_timeout_s"]
        assert r.status_code == 200, r.text
        if stream:
            text, chunks = streamed(r)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        else:
            text = r.json()["choices"][0]["text"]
        assert text == "ABCDEFGHIJKL"


@pytest.mark.parametrize("stream", [True, False])
def test_an_idle_gap_longer_than_the_idle_timeout_ends_the_request(loop, stubs, stream):
    engines, d = pd(stubs, num_tokens=12, token_delay_s=0.05, stall_after=3, stall_s=5.0)
    with serve(loop, engines, first_token_timeout_s=30, token_idle_timeout_s=0.5) as app:
        started = time.monotonic()
        r = post(app, stream=stream)
        assert time.monotonic() - started < 3.0  # the gap's bound, not the stall's end
        if stream:  # the tokens before the stall, then the error
            assert r.status_code == 200
            text, chunks = streamed(r)
            assert text == "ABC"
            error = chunks[-1]["error"]
        else:
            assert r.status_code == 504
            error = r.json()["error"]
        assert error["code"] == "deadline" and "token idle timeout" in error["message"], error
        rid = stubs.by_address[d].request_ids[0]
        wait_for(lambda: rid in stubs.by_address[d].aborted)  # D's request freed
        assert metric(app, "pdserve_coordinator_requests_total", endpoint="completions",
                      code="504") == 1


def test_a_late_first_token_ends_the_request_at_the_first_token_timeout(loop, stubs):
    engines, d = pd(stubs, prefill_delay_s=5.0, num_tokens=2, token_delay_s=5.0)
    with serve(loop, engines, first_token_timeout_s=0.5, token_idle_timeout_s=30) as app:
        started = time.monotonic()
        r = post(app)
        assert time.monotonic() - started < 3.0
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "deadline"
        assert "first-token timeout" in r.json()["error"]["message"]
        wait_for(lambda: stubs.by_address[d].request_ids[0] in stubs.by_address[d].aborted)


def test_a_continuation_waits_for_its_next_token_no_longer_than_the_idle_gap(loop, stubs):
    """D fails after two tokens; the continuation (on the same P and D, the only ones)
    would bring its first token 5 s later: it gets the idle gap from the last token, not
    the first token's 30 s."""
    engines, d = pd(stubs, prefill_delay_s=5.0, behavior="fail", fail_after=2, num_fail=1,
                    token_delay_s=5.0)
    with serve(loop, engines, first_token_timeout_s=30, token_idle_timeout_s=0.5) as app:
        started = time.monotonic()
        r = post(app, stream=True)
        assert time.monotonic() - started < 3.0
        text, chunks = streamed(r)
        assert text == "AB"
        error = chunks[-1]["error"]
        assert error["code"] == "deadline" and "token idle timeout" in error["message"], error
        assert metric(app, "pdserve_coordinator_continuations_total") == 1
        continuation = stubs.by_address[d].request_ids[1]
        wait_for(lambda: continuation in stubs.by_address[d].aborted)


@pytest.mark.parametrize("where", ["body", "header", "both"])
def test_a_clients_total_cuts_a_long_stream(loop, stubs, where):
    engines, d = pd(stubs, num_tokens=30, token_delay_s=0.2)  # 6 s in all
    body = {"request_timeout": 1.0 if where == "body" else 20.0} if where != "header" else {}
    headers = {"x-request-timeout": "1"} if where != "body" else {}
    with serve(loop, engines, first_token_timeout_s=30, token_idle_timeout_s=30) as app:
        started = time.monotonic()
        r = post(app, stream=True, headers=headers, **body)
        assert 0.9 < time.monotonic() - started < 4.0
        text, chunks = streamed(r)
        assert 1 <= len(text) < 30
        error = chunks[-1]["error"]
        assert error["code"] == "deadline" and "timeout of 1s" in error["message"], error
        wait_for(lambda: stubs.by_address[d].request_ids[0] in stubs.by_address[d].aborted)


def test_the_settings_total_applies_when_smaller_than_the_clients(loop, stubs):
    engines, _ = pd(stubs, num_tokens=30, token_delay_s=0.2)
    with serve(loop, engines, request_timeout_s=1.0) as app:
        r = post(app, request_timeout=20)
        assert r.status_code == 504
        assert "timeout of 1s" in r.json()["error"]["message"]


@pytest.mark.parametrize(("where", "value"), [
    ("body", "0"), ("body", "-1"), ("body", "0.5"), ("body", '"soon"'), ("body", "Infinity"),
    ("body", "NaN"), ("header", "0"), ("header", "soon"), ("header", "nan"), ("header", "1e999"),
])
def test_an_invalid_timeout_is_a_400_naming_it(loop, stubs, where, value):
    engines, d = pd(stubs)
    with serve(loop, engines) as app:
        if where == "body":  # as JSON text: Python's JSON reads Infinity and NaN
            raw = orjson.dumps(BODY)[:-1] + b', "request_timeout": ' + value.encode() + b"}"
            r = httpx.post(app.url + "/v1/completions", timeout=10, content=raw,
                           headers={"content-type": "application/json"})
        else:
            r = httpx.post(app.url + "/v1/completions", timeout=10, json=BODY,
                           headers={"x-request-timeout": value})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == ("request_timeout" if where == "body" else "x-request-timeout")
        assert not stubs.by_address[d].request_ids  # refused before any engine saw it


def test_the_chat_route_takes_the_clients_total_too(loop, stubs):
    engines, _ = pd(stubs, num_tokens=30, token_delay_s=0.2)
    with serve(loop, engines) as app:
        r = httpx.post(app.url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30,
            "request_timeout": 1})
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline"


def test_a_stream_longer_than_every_default_bound_runs_to_its_end(loop, stubs):
    # The defaults as shipped (no total; 60 s to the first token and between tokens):
    # an answer longer than any of them, a token every 0.5 s for 65 s, is not cut.
    defaults = CoordinatorSettings()
    assert defaults.request_timeout_s is None
    assert defaults.first_token_timeout_s < 65 and defaults.token_idle_timeout_s < 65
    engines, _ = pd(stubs, num_tokens=131, token_delay_s=0.5)
    with serve(loop, engines) as app:
        started = time.monotonic()
        r = httpx.post(app.url + "/v1/completions", timeout=200,
                       json={**BODY, "max_tokens": 131, "stream": True})
        elapsed = time.monotonic() - started
    assert r.status_code == 200
    _, chunks = streamed(r)
    assert elapsed >= 65
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    assert sum(1 for c in chunks if c.get("choices") and c["choices"][0]["text"]) == 131
