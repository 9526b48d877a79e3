"""What the output loop makes of the engines' messages: an answer that is not
streamed is decoded once at its end unless it has stop strings, into the text a
stream of the same tokens has; a stop string still ends it; the inter-token latency
is observed once per gap, rendered as prometheus_client renders a histogram; an
answer read whole is timed by its messages' arrival, though they are read at its end."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import orjson
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdserve.coordinator.metrics import LATENCY_BUCKETS, LoopHistogram
from pdserve.coordinator.sessions import EmbeddedEngine
from pdserve.runtime.engine_client import EngineClient, build_generate_request
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


def test_a_collected_answer_is_timed_by_its_messages_arrival(loop, stubs):
    """D sends a token every 30 ms. Read whole, the answer's messages after the first
    wait in the session call and are read at the end (``SessionCall.holds``), yet the
    first decode gap, the inter-token latencies and the TPOT are the engine's gaps, as
    for the same answer streamed; with a stop string every message is read as it
    comes (the stop may end it early), and the times are the same."""
    gap_s, num_tokens = 0.03, 6
    engines = [stubs(role="prefill"), stubs(role="decode", num_tokens=num_tokens, token_delay_s=gap_s)]
    body = {"model": "tiny", "prompt": "hello", "max_tokens": num_tokens}
    with serve(loop, engines) as app:
        for extra in ({}, {"stop": ["never there"]}, {"stream": True}):
            r = httpx.post(app.url + "/v1/completions", timeout=10, json={**body, **extra},
                           headers={"x-pdserve-timings": "1"})
            assert r.status_code == 200
        itl_sum, itl_count = metric(app, ITL + "_sum"), metric(app, ITL + "_count")
        stage = "pdserve_coordinator_stage_duration_seconds"
        first_decode = (metric(app, stage + "_sum", stage="first_decode"),
                        metric(app, stage + "_count", stage="first_decode"))
    assert itl_count == 3 * (num_tokens - 1)
    # Every gap is the engine's (30 ms, less a little for its own timer): read at the
    # end, the held messages would give gaps of about 0.
    assert itl_sum / itl_count >= gap_s * 0.8, itl_sum / itl_count
    assert first_decode[1] == 3 and first_decode[0] / 3 >= gap_s * 0.8


def test_a_held_call_wakes_its_reader_for_the_first_and_the_last_message(loop, stubs):
    address = stubs(role="decode", num_tokens=5, token_delay_s=0.02)

    async def scenario():
        client = EngineClient(address)
        session = EmbeddedEngine(client)
        try:
            call = session.generate(build_generate_request("held", prompt_token_ids=[1, 2],
                                                           max_tokens=5), 10.0)
            call.holds = True
            wakes, arrivals, read_at = 0, [], []
            real_wake = call._wake

            def counted_wake():
                nonlocal wakes
                if call._waiter is not None and not call._waiter.done():
                    wakes += 1
                real_wake()
            call._wake = counted_wake
            async for message in call:  # as a leg reads: to the finished message
                arrivals.append(call.arrival_s)
                read_at.append(asyncio.get_running_loop().time())
                if message.finished:
                    break
            return wakes, arrivals, read_at
        finally:
            await session.close()
            await client.close()

    wakes, arrivals, read_at = loop.run(scenario())
    assert len(arrivals) == 5 and wakes == 2  # the first message, then the finished one
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert all(g >= 0.015 for g in gaps), gaps  # stamped as they came
    assert read_at[-1] - read_at[1] < 0.01  # the rest were read together at the end
