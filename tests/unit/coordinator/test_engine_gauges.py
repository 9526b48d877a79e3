"""The Coordinator's /metrics carries each routable engine's load as it last reported
it (running and waiting requests, KV usage), so a dashboard needs no engine scrape to
see where the load is; an engine that leaves the view leaves the scrape."""

from __future__ import annotations

import time

import httpx

from pdserve.coordinator.app import create_app
from pdserve.coordinator.settings import CoordinatorSettings
from tests.unit.coordinator.harness import ALWAYS_PD, AppServer


def scrape(app) -> str:
    return httpx.get(app.url + "/metrics", timeout=10).text


def test_each_routable_engine_reports_its_load(loop, stubs):
    engines = [stubs(role="prefill"), stubs(role="decode")]
    settings = CoordinatorSettings(engines=tuple(engines), poll_interval_s=60.0, **ALWAYS_PD)
    with AppServer(loop, create_app(settings)) as app:  # one poll: the values set stay
        registry = app.deps.registry
        deadline = time.monotonic() + 10
        while len([i for i in registry.all() if i.routable]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        decode = next(i for i in registry.all() if i.role == "decode")
        decode.num_running, decode.num_waiting = 3, 2
        decode.num_kv_blocks_used, decode.num_kv_blocks_free = 16, 48
        text = scrape(app)
        labels = f'instance="{decode.instance_id}",role="decode"'
        assert f"pdserve_coordinator_engine_running_requests{{{labels}}} 3.0" in text
        assert f"pdserve_coordinator_engine_waiting_requests{{{labels}}} 2.0" in text
        assert f"pdserve_coordinator_engine_kv_usage_ratio{{{labels}}} 0.25" in text
        assert text.count("pdserve_coordinator_engine_kv_usage_ratio{") == 2
        decode.draining = True  # no longer routable: gone from the next scrape
        assert f"pdserve_coordinator_engine_running_requests{{{labels}}}" not in scrape(app)
