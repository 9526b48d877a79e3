"""A client that goes away, whenever it does: counted as such, logged at DEBUG, its legs
aborted, and no error (nor traceback) in the server's log."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from pdserve.coordinator.http_server import CLIENT_HOOK, ClientHook
from pdserve.coordinator.serving import ClientGone, DisconnectWatch
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
    # P's first token goes out as soon as P has it, D's when D has the KV: both late.
    decode = stubs(role="decode", num_tokens=100, token_delay_s=first_token_s)
    prefill = stubs(role="prefill", prefill_delay_s=first_token_s)
    with serve(loop, [prefill, decode]) as app, uvicorn_records(caplog):
        leave(app.url + "/v1/completions", when)
        wait_for(lambda: stubs.by_address[decode].aborted)  # its legs ended on the engines
        wait_for(lambda: metric(app, "pdserve_coordinator_aborts_total", reason="client_gone") == 1)
        assert metric(app, "pdserve_coordinator_requests_total", endpoint="completions",
                      code="499") == 1
    gone = [r for r in caplog.records if r.name == "pdserve.coordinator.output"
            and "went away" in r.getMessage()]
    assert [r.levelno for r in gone] == [logging.DEBUG]
    if when == "mid_stream":  # the access line says what the metrics say
        access = [r.getMessage() for r in caplog.records if r.name == "pdserve.access"
                  and "/v1/completions" in r.getMessage()]
        assert len(access) == 1 and " POST /v1/completions 499 " in access[0], access
    # The Coordinator's log (pdserve, uvicorn); the stub engines' gRPC server logs apart.
    assert [e for e in errors(caplog) if e.startswith(("pdserve", "uvicorn"))] == []


@pytest.mark.parametrize("served_by", ["coordinator_protocol", "another_server"])
def test_the_disconnect_watch_cancels_the_work_when_the_client_goes(served_by):
    """Under the Coordinator's protocol the request's ``ClientHook`` tells the watch;
    under a server without it, one watcher task waits on ``receive``."""
    async def scenario():
        for client_leaves in (True, False):
            gone, hook = asyncio.Event(), ClientHook()

            async def receive(gone=gone):
                await gone.wait()
                return {"type": "http.disconnect"}

            scope = {CLIENT_HOOK: hook} if served_by == "coordinator_protocol" else {}
            if client_leaves:
                with pytest.raises(ClientGone), DisconnectWatch(scope, receive):
                    asyncio.get_running_loop().call_later(0.05, hook.fire)
                    asyncio.get_running_loop().call_later(0.05, gone.set)
                    await asyncio.sleep(5)  # the work, cut short
            else:  # closed with the client still there: nothing cancelled, the hook let go
                with DisconnectWatch(scope, receive) as watch:
                    await asyncio.sleep(0.01)
                assert not watch.gone and hook.callback is None

    asyncio.run(asyncio.wait_for(scenario(), 5))
