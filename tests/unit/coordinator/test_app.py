"""The app over real HTTP with stub engines: errors (logged and counted), auth, limits,
admission, retries."""

from __future__ import annotations

import logging
import threading

import httpx
import pytest

from tests.unit.coordinator.harness import BODY, metric, serve


def test_pd_with_stubs_and_openai_errors(loop, stubs):
    engines = [stubs(role="prefill"), stubs(role="decode", num_tokens=3)]
    with serve(loop, engines) as app:
        r = httpx.post(app.url + "/v1/completions", json=BODY, headers={"x-request-id": "abc-1"})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "abc-1"
        assert r.json()["choices"][0]["text"] == "ABC"
        assert r.json()["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                                    "prompt_tokens_details": {"cached_tokens": 0}}
        r = httpx.post(app.url + "/v1/completions", json={**BODY, "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = httpx.post(app.url + "/v1/completions", json={**BODY, "temperature": 7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        r = httpx.post(app.url + "/v1/completions", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = httpx.post(app.url + "/v1/completions", json={**BODY, "prompt": "x" * 2_000_000})
        assert r.status_code == 413
        assert httpx.get(app.url + "/ready").status_code == 200


def test_api_key_guards_v1_only(loop, stubs, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    with serve(loop, [stubs()], api_key_file=str(key_file)) as app:
        assert httpx.post(app.url + "/v1/completions", json=BODY).status_code == 401
        wrong = httpx.get(app.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.get(app.url + "/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.json()["data"][0]["id"] == "tiny"
        for path in ("/health", "/ready", "/metrics"):
            assert httpx.get(app.url + path).status_code == 200


def test_beyond_concurrency_and_queue_is_429(loop, stubs):
    slow = stubs(num_tokens=20, token_delay_s=0.05)
    with serve(loop, [slow], max_concurrency=1, max_queue=0) as app:
        results = {}
        t = threading.Thread(target=lambda: results.setdefault(
            "first", httpx.post(app.url + "/v1/completions", json={**BODY, "max_tokens": 20}, timeout=10)))
        t.start()
        for _ in range(100):
            if app.app.state.admission.num_running:
                break
            threading.Event().wait(0.01)
        r = httpx.post(app.url + "/v1/completions", json=BODY)
        t.join()
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert results["first"].status_code == 200
        assert metric(app, "pdserve_coordinator_rejected_total", reason="queue_full") == 1


@pytest.mark.parametrize("failing, stage", [("prefill", "before_handoff"),
                                            ("decode", "before_first_token")])
def test_prefill_and_decode_failures_are_retried(loop, stubs, failing, stage):
    """One failing engine beside a working one in one pool (a failing P and D together
    race: whichever leg fails first is the one retried)."""
    other = "decode" if failing == "prefill" else "prefill"
    # A stub D streams at once; a real one waits for P's KV. Its first token comes after
    # a failing P's answer, as it would be: P's failure ends the attempt. A failing D
    # fails before a slow P's first token, which would otherwise go out first.
    delay = {"token_delay_s": 0.2} if other == "decode" else {"prefill_delay_s": 0.2}
    engines = [stubs(role=failing, behavior="fail", num_tokens=2), stubs(role=failing, num_tokens=2),
               stubs(role=other, num_tokens=2, **delay)]
    with serve(loop, engines, prefill_policy="round_robin", decode_policy="round_robin") as app:
        for _ in range(4):  # round robin: the failing engine is chosen within two requests
            r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "AB"
        assert metric(app, "pdserve_coordinator_retries_total", leg=failing, stage=stage) >= 1


def test_retry_budget_ends_with_a_clear_error(loop, stubs):
    engines = [stubs(role="prefill"), stubs(role="decode", behavior="fail")]
    with serve(loop, engines, max_retries=2) as app:
        r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 502 and "gave up after 3 failed attempts" in r.json()["error"]["message"]


def test_fail_fallback_is_503_with_reason(loop, stubs):
    with serve(loop, [stubs(role="prefill")], fallback_policy="fail") as app:
        r = httpx.post(app.url + "/v1/completions", json=BODY)
        assert r.status_code == 503 and "no decode engine" in r.json()["error"]["message"]
        assert httpx.get(app.url + "/ready").status_code == 503
        assert metric(app, "pdserve_coordinator_fallbacks_total", policy="fail",
                      reason="no_decode_engine") == 1


def test_refusals_and_failures_are_logged_once_each_and_counted_by_status(loop, stubs, caplog, tmp_path):
    """Refusals before admission (auth, body size, validation, unknown model or path) and
    failures after it: one log line each with status and reason, no traceback, and one
    count by status (a failure counted by the request is not counted again)."""
    key = tmp_path / "key"
    key.write_text("k")
    auth = {"Authorization": "Bearer k"}
    caplog.set_level(logging.INFO, logger="pdserve.coordinator")
    with serve(loop, [stubs(role="prefill")], fallback_policy="fail", api_key_file=str(key)) as app:
        def post(body, headers=auth):
            return httpx.post(app.url + "/v1/completions", json=body, headers=headers, timeout=10)

        assert post({**BODY, "model": "other"}).status_code == 404
        assert post({**BODY, "temperature": 7}).status_code == 400
        assert post(BODY, headers={}).status_code == 401
        assert post({**BODY, "prompt": "x" * 2_000_000}).status_code == 413
        assert post(BODY).status_code == 503  # admitted, then no decode engine (policy fail)
        assert httpx.get(app.url + "/v1/nothing", headers=auth).status_code == 404
        counts = {(e, c): metric(app, "pdserve_coordinator_requests_total", endpoint=e, code=str(c))
                  for e, c in (("completions", 404), ("completions", 400), ("completions", 401),
                               ("completions", 413), ("completions", 503), ("other", 404))}
    assert set(counts.values()) == {1.0}, counts
    lines = [r for r in caplog.records if r.name == "pdserve.coordinator.app"]
    messages = [r.getMessage() for r in lines]
    assert len(messages) == 6, messages
    assert "rejected - POST /v1/completions: 404 model_not_found: model 'other' does not exist" in messages[0]
    assert messages[1].startswith("rejected - POST /v1/completions: 400 invalid_request: temperature")
    assert messages[2].startswith("rejected - POST /v1/completions: 401 invalid_api_key")
    assert messages[3].startswith("rejected - POST /v1/completions: 413 body_too_large")
    assert messages[4].startswith("failed cmpl-") and ": 503 " in messages[4]
    assert messages[5].startswith("rejected - GET /v1/nothing: 404 -: Not Found")
    assert [r.levelno for r in lines] == [logging.INFO] * 4 + [logging.WARNING, logging.INFO]
    assert not any(r.exc_info for r in caplog.records)
