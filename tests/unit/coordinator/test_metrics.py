"""The Coordinator's lock-free metrics render as prometheus_client's own: a kept
counter's children and series are a ``Counter``'s, a labelled loop histogram's series
are a labelled ``Histogram``'s (without ``_created``), and the admission gauges say
what admission holds when rendered."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from pdserve.coordinator.admission import Admission
from pdserve.coordinator.metrics import (
    LATENCY_BUCKETS,
    CoordinatorMetrics,
    KeptCounter,
    LoopHistogram,
)


def lines(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines()
            if "_created" not in line]


def test_a_kept_counter_is_a_counter_with_its_children_kept():
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Counter("calls", "Calls.", ["leg", "code"], registry=theirs)
    counter = KeptCounter("calls", "Calls.", ["leg", "code"], registry=ours)
    for leg, code, n in (("prefill", 200, 1), ("decode", "503", 2), ("prefill", "200", 3)):
        reference.labels(leg, code).inc(n)
        counter.labels(leg, code).inc(n)
    counter.labels(leg="decode", code="503").inc()
    reference.labels(leg="decode", code="503").inc()
    assert counter.labels("prefill", "200") is counter.labels("prefill", "200")
    assert counter.labels("prefill", 200) is counter.labels(leg="prefill", code="200")
    assert lines(ours) == lines(theirs)
    assert ours.get_sample_value("calls_total", {"leg": "prefill", "code": "200"}) == 4


def test_a_labelled_loop_histogram_renders_as_a_labelled_histogram():
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    stages = ("route", "kv_transfer", "decode_wait")
    reference = Histogram("stage_seconds", "Stages.", ["stage"], buckets=LATENCY_BUCKETS,
                          registry=theirs)
    histogram = LoopHistogram("stage_seconds", "Stages.", LATENCY_BUCKETS, ours,
                              labelnames=("stage",), series=[(s,) for s in stages])
    for s in stages:
        reference.labels(s)  # every series from zero, as the Coordinator creates them
    for stage, seconds in (("route", 0.0), ("kv_transfer", 0.001), ("route", 3.0), ("route", 99.0)):
        reference.labels(stage).observe(seconds)
        histogram.labels(stage).observe(seconds)
    assert lines(ours) == lines(theirs)
    assert ours.get_sample_value("stage_seconds_count", {"stage": "route"}) == 3
    assert ours.get_sample_value("stage_seconds_count", {"stage": "decode_wait"}) == 0


def test_the_admission_gauges_read_admission_when_rendered():
    metrics = CoordinatorMetrics()
    admission = Admission(max_concurrency=1, max_queue=4, metrics=metrics)
    gauge = metrics.registry.get_sample_value

    async def go():
        slot = await admission.acquire(time.monotonic() + 60)
        waiter = asyncio.ensure_future(admission.acquire(time.monotonic() + 60))
        await asyncio.sleep(0)
        assert (gauge("pdserve_coordinator_inflight_requests"),
                gauge("pdserve_coordinator_queued_requests")) == (1, 1)
        slot.release()
        (await waiter).release()

    asyncio.run(go())
    assert (gauge("pdserve_coordinator_inflight_requests"),
            gauge("pdserve_coordinator_queued_requests")) == (0, 0)
