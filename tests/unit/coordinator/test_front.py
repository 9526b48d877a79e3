"""The one HTTP path (``front.CoordinatorApp``): the stream writer's batching and
clean-up, the completions' answers and log lines, and every route behind the same
guard, error answers and access line."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

from pdserve.coordinator.http_server import write_stream
from tests.unit.coordinator.harness import BODY, metric, serve


class Sends:
    """An ASGI ``send`` that records the bodies; ``fail`` makes the next one raise."""

    def __init__(self) -> None:
        self.bodies: list[tuple[bytes, bool]] = []
        self.fail: BaseException | None = None

    async def __call__(self, message) -> None:
        if self.fail is not None:
            raise self.fail
        self.bodies.append((message["body"], message["more_body"]))


def test_events_ready_together_leave_in_one_send_and_what_waits_is_sent_first():
    async def main():
        gate = asyncio.get_running_loop().create_future()
        sends = Sends()

        async def events():
            yield b"a"
            yield b"b"
            await gate  # the next event is not there yet
            yield b"c"
            yield b"d"

        writer = asyncio.ensure_future(write_stream(events(), sends))
        await asyncio.sleep(0.01)
        assert sends.bodies == [(b"ab", True)]  # sent before waiting, not after
        gate.set_result(None)
        await writer
        assert sends.bodies == [(b"ab", True), (b"cd", False)]

    asyncio.run(main())


def test_a_stream_cancelled_while_it_waits_cleans_up_and_sends_nothing_more():
    async def main():
        sends, seen = Sends(), []

        async def events():
            try:
                yield b"a"
                await asyncio.sleep(10)
                yield b"never"
            except BaseException as exc:
                seen.append(type(exc).__name__)
                raise
            finally:
                await asyncio.sleep(0)  # clean-up that waits, as closing the legs may
                seen.append("finally")

        writer = asyncio.ensure_future(write_stream(events(), sends))
        await asyncio.sleep(0.01)
        writer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writer
        assert seen == ["CancelledError", "finally"]
        assert sends.bodies == [(b"a", True)]

    asyncio.run(main())


def test_a_send_that_fails_while_a_step_waits_is_seen_by_the_stream():
    async def main():
        sends, seen = Sends(), []
        sends.fail = ConnectionResetError("gone")

        async def events():
            try:
                yield b"a"
                await asyncio.sleep(10)
                yield b"never"
            except BaseException as exc:
                seen.append(type(exc).__name__)
                raise

        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(write_stream(events(), sends), 5)
        assert seen == ["ConnectionResetError"]

    asyncio.run(main())


def test_an_error_event_after_tokens_still_ends_the_body():
    async def main():
        sends = Sends()

        async def events():
            yield b"a"
            await asyncio.sleep(0)
            yield b"error"

        await write_stream(events(), sends)
        assert b"".join(b for b, _ in sends.bodies) == b"aerror"
        assert sends.bodies[-1][1] is False

    asyncio.run(main())


@pytest.mark.parametrize("body, message", [
    (b'{"model": "tiny", "prompt": ', "the request body is not JSON"),
    (b"", "the request body is not JSON"),
    (b"[1, 2]", "Input should be a valid dictionary"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "many"}', "max_tokens: "),
])
def test_a_body_that_is_not_a_request_is_a_400_saying_why(loop, stubs, body, message):
    with serve(loop, [stubs(num_tokens=2)]) as app:
        r = httpx.post(app.url + "/v1/completions", content=body, timeout=10,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_request" and message in error["message"], error


def test_each_completion_has_its_access_line_and_a_stream_its_events(loop, stubs, caplog):
    # The level is set before the server starts and restored after it stopped: a line is
    # written after the answer's last byte, so the client can read the answer first.
    with caplog.at_level(logging.DEBUG, "pdserve.access"), serve(loop, [stubs(num_tokens=5)]) as app:
        r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10,
                       headers={"x-request-id": "client-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "client-1"
        with httpx.stream("POST", app.url + "/v1/completions", timeout=10,
                          json={**BODY, "max_tokens": 5, "stream": True}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            events = [line for line in s.iter_lines() if line]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        r = httpx.post(app.url + "/v1/completions", json={**BODY, "model": "other"}, timeout=10)
        assert r.status_code == 404
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "pdserve.access"]
    assert any("client-1 POST /v1/completions 200" in line for line in lines), lines
    assert sum("POST /v1/completions 200" in line for line in lines) == 2, lines
    # Refused before it had an id: a DEBUG line (its INFO line is the rejection's).
    assert any("- POST /v1/completions 404" in line for line in lines), lines


KEY = {"Authorization": "Bearer k1"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# Every route the Coordinator serves (the status page aside: test_access.py), with a
# body that it answers 200; "/v1/" ones need the API key.
ROUTES = [
    ("GET", "/v1/models", None), ("POST", "/v1/completions", BODY),
    ("POST", "/v1/chat/completions", CHAT), ("GET", "/health", None), ("GET", "/ready", None),
    ("GET", "/metrics", None), ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [104, 105]}), ("GET", "/openapi.json", None),
]


def _lines(caplog, method: str, path: str, num_access: int = 1) -> tuple[list[str], list[str]]:
    """(access lines, error lines) logged about ``method path``, once ``num_access``
    access lines are there or after 2 s: a line is written after the answer's last
    byte, which the client may read first. An error line comes before the answer."""
    deadline = time.monotonic() + 2.0
    while True:
        access = [r.getMessage() for r in caplog.records if r.name == "pdserve.access"
                  and f" {method} {path} " in r.getMessage()]
        if len(access) >= num_access or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    errors = [r.getMessage() for r in caplog.records if r.name == "pdserve.coordinator.app"
              and f" {method} {path}: " in r.getMessage()]
    return access, errors


def test_every_route_passes_the_one_guard_and_has_one_line_per_request(loop, stubs, tmp_path,
                                                                       caplog):
    """Each route, answered: one access line. Refused by the guard (no key on /v1/*, a
    body past the limit on every POST): the error's one line and one count, no access
    line."""
    (tmp_path / "key").write_text("k1\n")
    caplog.set_level(logging.INFO, logger="pdserve.coordinator.app")
    caplog.set_level(logging.DEBUG, logger="pdserve.access")  # last: the handler's level too
    with serve(loop, [stubs(num_tokens=2)], api_key_file=str(tmp_path / "key"),
               max_body_bytes=4096) as app:
        for method, path, body in ROUTES:
            caplog.clear()
            r = httpx.request(method, app.url + path, json=body, headers=KEY, timeout=10)
            assert r.status_code == 200, (path, r.text)
            access, errors = _lines(caplog, method, path)
            assert len(access) == 1 and f" {method} {path} 200 " in access[0], (path, access)
            assert errors == [], (path, errors)

            caplog.clear()
            r = httpx.request(method, app.url + path, json=body, timeout=10)
            is_open = not path.startswith("/v1/")
            access, errors = _lines(caplog, method, path, int(is_open))
            if not is_open:
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                assert access == [] and len(errors) == 1, (path, access, errors)
                assert f"rejected - {method} {path}: 401 invalid_api_key" in errors[0]
            else:
                assert r.status_code == 200 and len(access) == 1 and errors == [], path

            if method == "POST":
                caplog.clear()
                r = httpx.post(app.url + path, content=b"[" + b"1," * 4096 + b"1]",
                               headers=KEY, timeout=10)
                assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
                access, errors = _lines(caplog, method, path, 0)
                assert access == [] and len(errors) == 1, (path, access, errors)
                assert f"rejected - POST {path}: 413 body_too_large" in errors[0]
        for endpoint in ("completions", "chat"):
            assert metric(app, "pdserve_coordinator_requests_total", endpoint=endpoint,
                          code="401") == 1
            assert metric(app, "pdserve_coordinator_requests_total", endpoint=endpoint,
                          code="413") == 1
        # /v1/models, /tokenize and /detokenize count as "other"
        assert metric(app, "pdserve_coordinator_requests_total", endpoint="other", code="401") == 1
        assert metric(app, "pdserve_coordinator_requests_total", endpoint="other", code="413") == 2


def test_every_route_answers_errors_the_same_way(loop, stubs, caplog):
    """A route's own refusals (validation, unknown path, wrong method) are OpenAI's error
    JSON, logged and counted once, with an access line; a bug is a 500 with its
    traceback logged once."""
    caplog.set_level(logging.INFO, logger="pdserve.coordinator")
    caplog.set_level(logging.DEBUG, logger="pdserve.access")  # last: the handler's level too
    with serve(loop, [stubs(num_tokens=2)]) as app:
        for method, path, body, status in [
            ("POST", "/tokenize", {"prompt": 5}, 400),
            ("POST", "/v1/completions", {**BODY, "max_tokens": "many"}, 400),
            ("GET", "/ready?verbose=maybe", None, 400),
            ("GET", "/v1/nothing", None, 404),
            ("GET", "/v1/completions", None, 405),
        ]:
            caplog.clear()
            r = httpx.request(method, app.url + path, json=body, timeout=10)
            assert r.status_code == status, (path, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            access, errors = _lines(caplog, method, path.partition("?")[0])
            assert len(access) == 1 and f" {status} " in access[0], (path, access)
            assert len(errors) == 1 and f": {status} " in errors[0], (path, errors)
        assert metric(app, "pdserve_coordinator_requests_total", endpoint="other", code="400") == 2

        def broken() -> int:
            raise RuntimeError("a bug")

        app.deps.registry.max_model_len = broken
        caplog.clear()
        r = httpx.get(app.url + "/v1/models", timeout=10)
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        tracebacks = [rec for rec in caplog.records if rec.exc_info]
        assert len(tracebacks) == 1 and "a bug" in str(tracebacks[0].exc_info[1])
        access, errors = _lines(caplog, "GET", "/v1/models")
        assert len(access) == 1 and len(errors) == 1 and ": 500 internal_error" in errors[0]


def test_access_line_has_the_request_id(loop, stubs, caplog):
    with caplog.at_level(logging.INFO, "pdserve.access"), serve(loop, [stubs(num_tokens=2)]) as app:
        r = httpx.post(app.url + "/v1/completions", json={**BODY, "stream": True}, timeout=10,
                       headers={"x-request-id": "cmpl-42"})
        assert r.status_code == 200
    [rec] = [rec for rec in caplog.records if rec.name == "pdserve.access"]
    assert rec.request_id == "cmpl-42"
    assert "cmpl-42 POST /v1/completions 200" in rec.getMessage()
