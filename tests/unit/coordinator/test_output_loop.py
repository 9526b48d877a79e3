"""What the output loop makes of the engines' messages: an answer that is not
streamed is decoded once at its end unless it has stop strings, into the text a
stream of the same tokens has; a stop string still ends it; the inter-token latency
is observed once per gap, rendered as prometheus_client renders a histogram."""

from __future__ import annotations

import httpx
import orjson
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdserve.coordinator.metrics import LATENCY_BUCKETS, LoopHistogram
from tests.unit.coordinator.harness import metric, serve

ITL = "pdserve_coordinator_inter_token_latency_seconds"


def events(body: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]


def test_an_answer_decoded_at_its_end_is_the_streamed_text(loop, stubs):
    """Two-byte characters split over messages: "é" is 0xC3 0xA9, one byte per token."""
    engines = [stubs(role="prefill", num_tokens=6, token_ids=[0xC3, 0xA9, 0x21]),
               stubs(role="decode", num_tokens=6, token_ids=[0xC3, 0xA9, 0x21])]
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 6}
    with serve(loop, engines) as app:
        whole = httpx.post(app.url + "/v1/completions", timeout=10, json=body).json()
        r = httpx.post(app.url + "/v1/completions", timeout=10, json={**body, "stream": True})
        assert metric(app, ITL + "_count") == 2 * 5  # both answers' gaps
    streamed = "".join(orjson.loads(e)["choices"][0]["text"]
                       for e in events(r.content)[:-1])
    assert whole["choices"][0]["text"] == streamed == "é!é!"
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 6


def test_a_stop_string_ends_an_answer_that_is_not_streamed(loop, stubs):
    engines = [stubs(role="prefill", num_tokens=6, token_ids=[0xC3, 0xA9, 0x21]),
               stubs(role="decode", num_tokens=6, token_ids=[0xC3, 0xA9, 0x21])]
    with serve(loop, engines) as app:
        out = httpx.post(app.url + "/v1/completions", timeout=10, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 6, "stop": ["!é"]}).json()
        assert metric(app, "pdserve_coordinator_aborts_total", reason="stop_string") == 1
    assert (out["choices"][0]["text"], out["choices"][0]["finish_reason"]) == ("é", "stop")


def test_loop_histogram_renders_as_a_prometheus_histogram():
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("gap_seconds", "Gaps.", buckets=LATENCY_BUCKETS, registry=theirs)
    histogram = LoopHistogram("gap_seconds", "Gaps.", LATENCY_BUCKETS, ours)
    for seconds in (0.0, 0.0005, 0.0007, 0.01, 0.3, 100.0):  # on a bound, between, past all
        reference.observe(seconds)
        histogram.observe(seconds)
    expected = [line for line in generate_latest(theirs).decode().splitlines()
                if "_created" not in line]
    assert generate_latest(ours).decode().splitlines() == expected
    assert ours.get_sample_value("gap_seconds_bucket", {"le": "0.0005"}) == 2
    assert ours.get_sample_value("gap_seconds_count") == 6
