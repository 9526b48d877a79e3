"""P's report in the answer, whichever leg's stream ends first. P's stage timings
(queue and compute with its first message, transfer with its handoff) and its
prefix-cache hits ride P's stream; D's whole answer rides another connection and can
be read before P's first message. The answer waits for P's report (a bounded wait),
so its timings, its usage's cached tokens and the stage metrics hold it."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from pdserve.coordinator import legs
from tests.unit.coordinator.harness import BODY, metric, serve
from tests.unit.coordinator.test_output_loop import events
from tests.unit.coordinator.test_quiet_logs import wait_for

P_STAGES = ("prefill_queue_s", "prefill_compute_s", "kv_transfer_s")
STAGE_COUNT = "pdserve_coordinator_stage_duration_seconds_count"


def late_p_engines(stubs, prefill_delay_s: float) -> list[str]:
    """P's messages come ``prefill_delay_s`` after D's whole answer (D answers at once)."""
    return [stubs(role="prefill", prefill_delay_s=prefill_delay_s, num_cached_tokens=5),
            stubs(role="decode", num_tokens=3)]


def answer(app, stream: bool) -> tuple[dict, dict]:
    """(the timings, the usage) of one request, streamed or not."""
    r = httpx.post(app.url + "/v1/completions", timeout=10, headers={"x-pdserve-timings": "1"},
                   json={**BODY, "stream": stream, "stream_options": {"include_usage": True}
                         if stream else None})
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["pdserve_timings"], r.json()["usage"]
    chunks = [orjson.loads(e) for e in events(r.content) if e != "[DONE]"]
    timings = [c["pdserve_timings"] for c in chunks if "pdserve_timings" in c]
    assert len(timings) == 1 and chunks[-1]["choices"] == []  # on the last chunk; then usage
    return timings[0], chunks[-1]["usage"]


@pytest.mark.parametrize("stream", [False, True])
def test_ps_report_reaches_the_answer_when_d_finished_first(loop, stubs, stream):
    with serve(loop, late_p_engines(stubs, 0.5)) as app:
        timings, usage = answer(app, stream)
        assert all(key in timings for key in P_STAGES), timings
        assert "decode_wait_s" in timings
        assert usage["prompt_tokens_details"]["cached_tokens"] == 5
        assert usage["completion_tokens"] == 3
        for stage in ("prefill_queue", "prefill_compute", "kv_transfer", "decode_wait"):
            assert metric(app, STAGE_COUNT, stage=stage) == 1, stage
        assert [e.num_inflight for e in app.deps.registry.all()] == [0, 0]


def test_an_answer_waits_for_ps_report_no_longer_than_its_bound(loop, stubs, monkeypatch):
    """A P whose report never comes (here: 3 s late) holds the answer for REPORT_WAIT_S
    only; the answer goes without P's stages, and P ends by itself."""
    monkeypatch.setattr(legs, "REPORT_WAIT_S", 0.2)
    engines = late_p_engines(stubs, 3.0)
    with serve(loop, engines) as app:
        started = time.monotonic()
        timings, usage = answer(app, stream=False)
        assert 0.2 <= time.monotonic() - started < 2.0
        assert not any(key in timings for key in P_STAGES), timings
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        p = stubs.by_address[engines[0]]
        wait_for(lambda: not p._inflight)  # its handoff came; nobody aborted it
        assert p.aborted == []
        assert [e.num_inflight for e in app.deps.registry.all()] == [0, 0]
