"""Expected conditions log a line, never a traceback: a client that goes away, both
legs of a request refusing it, and engines failing the same way again and again
(one line per engine, leg and reason per interval, with a count of the rest)."""

from __future__ import annotations

import contextlib
import gc
import logging
import time

import httpx
import pytest

from pdserve.runtime.log_throttle import ThrottledLog
from tests.unit.coordinator.harness import BODY, metric, serve


@contextlib.contextmanager
def uvicorn_records(caplog):
    """uvicorn's loggers do not propagate to the root logger: listen to them too (after
    the server is built: its config resets their handlers)."""
    logger = logging.getLogger("uvicorn")
    logger.addHandler(caplog.handler)
    try:
        yield
    finally:
        logger.removeHandler(caplog.handler)


def errors(caplog) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records
            if r.levelno >= logging.ERROR or r.exc_info]


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_is_no_application_error(loop, stubs, caplog, stream):
    caplog.set_level(logging.INFO)
    decode = stubs(role="decode", num_tokens=100, token_delay_s=0.05)
    with serve(loop, [stubs(role="prefill"), decode]) as app, uvicorn_records(caplog):
        body = {**BODY, "max_tokens": 100, "stream": stream}
        if stream:  # leaves after two events
            with httpx.stream("POST", app.url + "/v1/completions", json=body, timeout=5) as r:
                assert [line for _, line in zip(range(3), r.iter_lines(), strict=False)]
        else:  # leaves while waiting for the answer
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(app.url + "/v1/completions", json=body, timeout=0.4)
        wait_for(lambda: stubs.by_address[decode].aborted)  # both legs ended on the engines
        wait_for(lambda: metric(app, "pdserve_coordinator_requests_total",
                                endpoint="completions", code="499") == 1)
        if not stream:
            assert metric(app, "pdserve_coordinator_aborts_total", reason="client_gone") == 1
    assert errors(caplog) == []


def test_both_legs_refusing_a_request_is_a_400_and_no_error(loop, stubs, caplog):
    caplog.set_level(logging.INFO)
    engines = [stubs(role="prefill", behavior="refuse"), stubs(role="decode", behavior="refuse")]
    with serve(loop, engines) as app, uvicorn_records(caplog):
        for _ in range(5):
            r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 400 and "longer than the model's context" in r.text
        loop.run(_collect())  # a forgotten task's error is reported when it is collected
    assert errors(caplog) == []


async def _collect() -> None:
    gc.collect()


def test_an_engine_failing_every_leg_is_logged_once_per_interval(loop, stubs, caplog):
    caplog.set_level(logging.INFO, logger="pdserve.coordinator")
    engines = [stubs(role="prefill"), stubs(role="decode", behavior="fail")]
    with serve(loop, engines, max_retries=0) as app:
        for _ in range(5):
            r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10)
            assert r.status_code == 502 and engines[1] not in r.text
    failed = [r for r in caplog.records if r.name == "pdserve.coordinator.lifecycle"]
    assert len(failed) == 1 and failed[0].levelno == logging.WARNING
    assert engines[1] in failed[0].getMessage()  # the log names the engine; the client is not told
    assert not any(r.exc_info for r in caplog.records)


def test_throttled_log_writes_one_line_per_key_per_interval_with_the_count(caplog):
    now = [0.0]
    log = ThrottledLog(logging.getLogger("test.throttle"), interval_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="test.throttle")
    assert log.log(logging.WARNING, ("e1", "UNAUTHENTICATED"), "refused by %s", "e1")
    for _ in range(3):
        assert not log.log(logging.WARNING, ("e1", "UNAUTHENTICATED"), "refused by %s", "e1")
    assert log.log(logging.WARNING, ("e2", "UNAUTHENTICATED"), "refused by %s", "e2")  # other key
    now[0] = 10.0
    assert log.log(logging.WARNING, ("e1", "UNAUTHENTICATED"), "refused by %s", "e1")
    assert [r.getMessage() for r in caplog.records] == [
        "refused by e1", "refused by e2", "refused by e1 (3 more like it in the last 10s)"]
