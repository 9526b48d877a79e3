"""Overload is backpressure, not failure: an engine answering "decode full" or
"prefill full" (RESOURCE_EXHAUSTED) is healthy. The request goes to an engine with
room, or waits for one, or ends with 503 and Retry-After; no retry is spent, no
engine is marked failed, and the refusals are counted and logged once."""

from __future__ import annotations

import logging
import threading
import time

import httpx

from tests.unit.coordinator.harness import BODY, metric, serve


def overloads(app, leg: str) -> float:
    return metric(app, "pdserve_coordinator_overload_total", leg=leg)


def retries(app) -> float:
    return sum(metric(app, "pdserve_coordinator_retries_total", leg=leg, stage=stage)
               for leg, stage in (("prefill", "before_handoff"), ("decode", "before_first_token"),
                                  ("decode", "mid_stream"), ("single", "before_first_token")))


def test_a_full_decode_engine_sends_requests_to_one_with_room(loop, stubs):
    full = stubs(role="decode", behavior="full")
    engines = [stubs(role="prefill"), full, stubs(role="decode", num_tokens=2)]
    with serve(loop, engines, decode_policy="round_robin") as app:
        for _ in range(4):
            r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "AB"
        assert overloads(app, "decode") >= 1 and retries(app) == 0
        engine = app.deps.registry.get(full)
        assert engine.suspect_until == 0 and engine.routable  # healthy, not failed


def test_a_full_prefill_engine_sends_requests_to_one_with_room(loop, stubs):
    # D waits before its first token as a real one waits for KV: P's refusal is read first.
    engines = [stubs(role="prefill", behavior="full"), stubs(role="prefill"),
               stubs(role="decode", num_tokens=2, token_delay_s=0.05)]
    with serve(loop, engines, prefill_policy="round_robin") as app:
        for _ in range(4):
            assert httpx.post(app.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
        assert overloads(app, "prefill") >= 1 and retries(app) == 0


def test_when_every_engine_is_full_the_request_waits_for_room(loop, stubs):
    decode = stubs(role="decode", behavior="full", num_full=3, num_tokens=2)
    with serve(loop, [stubs(role="prefill"), decode], max_retries=0) as app:
        r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10,
                       headers={"x-pdserve-timings": "1"})
        assert r.status_code == 200, r.text
        assert r.json()["pdserve_timings"]["attempts"] == 4  # three "full", then room
        assert overloads(app, "decode") == 3 and retries(app) == 0


def test_full_for_longer_than_the_wait_bound_is_503_with_retry_after(loop, stubs, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.coordinator")
    engines = [stubs(role="prefill"), stubs(role="decode", behavior="full")]
    with serve(loop, engines, overload_max_wait_s=0.5) as app:
        start = time.monotonic()
        r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10)
        assert time.monotonic() - start < 3
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        assert int(r.headers["retry-after"]) >= 1
        assert "decode full" in r.json()["error"]["message"]
        assert engines[1] not in r.json()["error"]["message"]  # no engine address to the client
        assert overloads(app, "decode") >= 3 and retries(app) == 0
        assert metric(app, "pdserve_coordinator_requests_total", endpoint="completions",
                      code="503") == 1
    # Many refusals, one line (ThrottledLog), and no traceback.
    full_lines = [r for r in caplog.records if "has no room" in r.getMessage()]
    assert len(full_lines) == 1 and "decode full" in full_lines[0].getMessage()
    assert not any(r.exc_info for r in caplog.records)


def test_the_coordinators_own_queue_full_is_429_with_retry_after(loop, stubs):
    engines = [stubs(role="prefill"), stubs(role="decode", behavior="full")]
    with serve(loop, engines, max_concurrency=1, max_queue=0, overload_max_wait_s=2) as app:
        first = {}
        t = threading.Thread(target=lambda: first.setdefault(
            "r", httpx.post(app.url + "/v1/completions", json=BODY, timeout=10)))
        t.start()
        for _ in range(200):  # the first request holds the only slot while it waits for room
            if app.app.state.admission.num_running:
                break
            time.sleep(0.01)
        r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        t.join()
        assert first["r"].status_code == 503 and first["r"].headers["retry-after"]


def test_a_prefill_relaying_its_decodes_full_marks_the_decode_engine_full(loop, stubs):
    relaying = stubs(role="prefill", behavior="peer_full")
    # Stub decode engines wait before their first token as real ones wait for P's KV, so
    # P's relayed refusal is in first (a stub streaming at once would race it).
    decodes = [stubs(role="decode", num_tokens=2, token_delay_s=0.2) for _ in range(2)]
    engines = [relaying, decodes[0], stubs(role="prefill"), decodes[1]]
    with serve(loop, engines, prefill_policy="round_robin", decode_policy="round_robin") as app:
        for _ in range(4):
            assert httpx.post(app.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
        assert overloads(app, "decode") >= 1 and overloads(app, "prefill") == 0
        assert retries(app) == 0
        # The D paired with the relaying P (round robin picks either) is the one marked
        # full; the P that only relayed D's answer never is.
        assert any(app.deps.registry.get(d).full_until > 0 for d in decodes)
        assert app.deps.registry.get(relaying).full_until == 0
