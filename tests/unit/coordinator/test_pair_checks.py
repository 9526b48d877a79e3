"""Readiness that means it: the Coordinator pairs P and D only over pairs whose KV path
answered a probe (stub engines' ProbePeer), and /ready?verbose=1 says which pairs are
usable and why the others are not."""

from __future__ import annotations

import time

import httpx

from tests.unit.coordinator.harness import BODY, serve


def test_pd_is_never_routed_over_a_pair_whose_probe_failed(loop, stubs):
    d_bad = stubs(role="decode", num_tokens=2, kv_endpoint="10.9.9.9:7001")
    d_good = stubs(role="decode", num_tokens=2, kv_endpoint="10.9.9.9:7002")
    p = stubs(role="prefill", probe_failures={
        "10.9.9.9:7001": "cannot reach KV endpoint 10.9.9.9:7001: connection refused"})
    with serve(loop, [p, d_bad, d_good], decode_policy="round_robin") as app:
        for _ in range(4):
            r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 200, r.text
        assert stubs.by_address[d_bad].request_ids == []
        assert len(stubs.by_address[d_good].request_ids) == 4
        assert set(stubs.by_address[p].probed) >= {"10.9.9.9:7001", "10.9.9.9:7002"}

        ready = httpx.get(app.url + "/ready", params={"verbose": 1})
        assert ready.status_code == 200
        pairs = {row["decode"]: row for row in ready.json()["pairs"]}
        assert pairs[d_good]["usable"] and pairs[d_good]["reason"] == ""
        assert not pairs[d_bad]["usable"]
        assert "connection refused" in pairs[d_bad]["reason"]
        assert ready.json()["detail"]["pd"] == "ok"


def test_no_usable_pair_means_not_ready_with_the_reason(loop, stubs):
    d = stubs(role="decode", kv_endpoint="10.9.9.9:7003")
    p = stubs(role="prefill", probe_failures={"10.9.9.9:7003": "incompatible KV layout: block_size"})
    other = stubs(role="decode", kv_compat_hash="other-model", kv_endpoint="10.9.9.9:7004")
    with serve(loop, [p, d, other], fallback_policy="fail") as app:
        r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 503 and "no probed pair" in r.json()["error"]["message"]
        ready = httpx.get(app.url + "/ready?verbose=1")
        assert ready.status_code == 503
        assert ready.json()["detail"]["pd"] == "no_probed_pair"
        reasons = {row["decode"]: row["reason"] for row in ready.json()["pairs"]}
        assert "incompatible KV layout" in reasons[d]
        assert "compatibility hashes differ" in reasons[other]
        assert "10.9.9.9:7004" not in stubs.by_address[p].probed  # never probed: hashes differ


def test_a_pair_that_comes_good_is_routed_after_its_next_probe(loop, stubs):
    d = stubs(role="decode", num_tokens=1, kv_endpoint="10.9.9.9:7005")
    p = stubs(role="prefill", probe_failures={"10.9.9.9:7005": "not yet"})
    with serve(loop, [p, d], fallback_policy="queue", pair_probe_retry_s=0.2,
               first_token_timeout_s=10) as app:
        assert httpx.get(app.url + "/ready").status_code == 503
        stubs.by_address[p].probe_failures.clear()  # the KV port comes up
        started = time.monotonic()
        r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 200, r.text
        assert time.monotonic() - started < 5
        assert httpx.get(app.url + "/ready").status_code == 200


def test_a_pair_whose_probe_failed_is_retried_while_the_request_waits(loop, stubs):
    """A busy P failed its pair's probe (a timeout under load): the pair checks retry it,
    so a request waits for the retry instead of a 503 at once, and is served."""
    d = stubs(role="decode", num_tokens=2, kv_endpoint="10.9.9.9:7005")
    p = stubs(role="prefill", probe_failures={"10.9.9.9:7005": "DEADLINE_EXCEEDED (busy)"})
    with serve(loop, [p, d], pair_probe_retry_s=0.3) as app:
        assert not httpx.get(app.url + "/ready", params={"verbose": 1}).json()["pairs"][0]["usable"]
        stubs.by_address[p].probe_failures.clear()  # no longer busy: the next probe passes
        r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10)
        assert r.status_code == 200, r.text
        assert stubs.by_address[d].request_ids
