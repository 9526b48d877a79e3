"""A client that goes away, whenever it does: counted as such, logged at DEBUG, its legs
aborted, and no error (nor traceback) in the server's log."""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.unit.coordinator.harness import BODY, metric, serve
from tests.unit.coordinator.test_quiet_logs import errors, uvicorn_records, wait_for


def leave(url: str, when: str) -> None:
    body = {**BODY, "max_tokens": 100, "stream": when != "before_answer"}
    if when == "mid_stream":  # after two events
        with httpx.stream("POST", url, json=body, timeout=5) as r:
            assert r.status_code == 200
            assert len([line for _, line in zip(range(3), r.iter_lines(), strict=False)]) == 3
        return
    # Before the answer (or, streamed, before its first token, which the response
    # waits for): the client's read times out and it closes the connection.
    with pytest.raises(httpx.ReadTimeout):
        if body["stream"]:
            with httpx.stream("POST", url, json=body, timeout=0.3):
                pass
        else:
            httpx.post(url, json=body, timeout=0.3)


@pytest.mark.parametrize("when", ["before_answer", "before_first_token", "mid_stream"])
def test_a_client_that_goes_away_is_counted_and_logged_at_debug(loop, stubs, caplog, when):
    caplog.set_level(logging.DEBUG, logger="pdserve")
    first_token_s = 1.0 if when == "before_first_token" else 0.05
    decode = stubs(role="decode", num_tokens=100, token_delay_s=first_token_s)
    with serve(loop, [stubs(role="prefill"), decode]) as app, uvicorn_records(caplog):
        leave(app.url + "/v1/completions", when)
        wait_for(lambda: stubs.by_address[decode].aborted)  # its legs ended on the engines
        wait_for(lambda: metric(app, "pdserve_coordinator_aborts_total", reason="client_gone") == 1)
        assert metric(app, "pdserve_coordinator_requests_total", endpoint="completions",
                      code="499") == 1
    gone = [r for r in caplog.records if r.name == "pdserve.coordinator.output"
            and "went away" in r.getMessage()]
    assert [r.levelno for r in gone] == [logging.DEBUG]
    # The Coordinator's log (pdserve, uvicorn); the stub engines' gRPC server logs apart.
    assert [e for e in errors(caplog) if e.startswith(("pdserve", "uvicorn"))] == []
