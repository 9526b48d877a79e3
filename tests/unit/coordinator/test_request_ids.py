"""Request identity is the Coordinator's: a client's ``x-request-id`` labels its
request (header, timings, logs) but never becomes an engine's request or transfer id."""

from __future__ import annotations

import re
import threading

import httpx

from pdserve.coordinator.lifecycle import new_request_id
from tests.unit.coordinator.harness import BODY, serve

LONGEST = "r" * 128


def test_two_concurrent_requests_with_the_same_client_id_both_succeed(loop, stubs):
    engines = [stubs(role="prefill"), stubs(role="decode", num_tokens=6, token_delay_s=0.05)]
    decode = stubs.by_address[engines[1]]
    with serve(loop, engines) as app:
        results = []

        def post():
            results.append(httpx.post(app.url + "/v1/completions", timeout=10,
                                      json={**BODY, "max_tokens": 6},
                                      headers={"x-request-id": "same-id"}))

        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in results] == [200, 200], [r.text for r in results]
        assert all(r.json()["choices"][0]["text"] == "ABCDEF" for r in results)
        assert all(r.headers["x-request-id"] == "same-id" for r in results)
        assert decode.max_inflight == 2  # they did overlap on the engine
        ids = {r.json()["id"] for r in results}
        assert len(ids) == 2 and set(decode.request_ids) == ids  # the Coordinator's own ids
        assert not decode.aborted


def test_the_longest_client_id_fits_and_labels_the_timings(loop, stubs):
    engines = [stubs(role="prefill"), stubs(role="decode", num_tokens=2)]
    with serve(loop, engines) as app:
        r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10,
                       headers={"x-request-id": LONGEST, "x-pdserve-timings": "1"})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == LONGEST
        assert r.json()["pdserve_timings"]["request_id"] == LONGEST
        engine_id = stubs.by_address[engines[1]].request_ids[0]
        assert engine_id == r.json()["id"] and len(f"x-{engine_id}.99") < 64


def test_a_client_id_that_cannot_be_a_label_is_refused_naming_the_header(loop, stubs):
    with serve(loop, [stubs()]) as app:
        for bad in (LONGEST + "r", "has space", "t\u00e9st"):
            r = httpx.post(app.url + "/v1/completions", json=BODY,
                           headers={"x-request-id": bad.encode()})
            assert r.status_code == 400, bad
            assert r.json()["error"]["param"] == "x-request-id"
            assert r.json()["error"]["code"] == "invalid_request_id"
        r = httpx.post(app.url + "/v1/completions", json=BODY)  # none: the Coordinator's id
        assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["id"]
        assert r.json()["id"].startswith("cmpl-")


def test_the_coordinators_ids_are_cmpl_and_32_hex_digits_never_repeated():
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids)


def test_chat_answers_are_chatcmpl_as_openais_and_the_status_page_counts_only_served(loop, stubs):
    with serve(loop, [stubs()]) as app:
        chat = httpx.post(app.url + "/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200
        assert chat.json()["id"] == "chat" + chat.headers["x-request-id"]
        assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", chat.json()["id"])
        stream = httpx.post(app.url + "/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 2, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]})
        assert '"id":"chatcmpl-' in stream.text.replace(" ", "")
        assert httpx.post(app.url + "/v1/completions", json={**BODY, "model": "other"}).status_code == 404
        assert httpx.post(app.url + "/v1/completions", json={**BODY, "max_tokens": -1}).status_code == 400
        assert httpx.get(app.url + "/v1/completions").status_code == 405
        assert httpx.get(app.url + "/ui/state").json()["requests_total"] == 2
