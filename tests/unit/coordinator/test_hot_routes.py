"""The completion routes' hot path: the stream writer's batching and clean-up, and the
answers and log lines it gives where FastAPI's layers used to."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from pdserve.coordinator.hot_routes import write_stream
from tests.unit.coordinator.harness import BODY, serve


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
