"""Every latency the Coordinator observes is a duration: never negative, whatever the
answer's shape (streamed or whole, ``n``, ``best_of``, echo, tool calls, a
stop string), through a PD pair and on one engine."""

from __future__ import annotations

import httpx
import pytest

from tests.unit.coordinator.harness import serve

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
SHAPES = [
    ("completions", {}),
    ("completions", {"stream": True}),
    ("completions", {"n": 3}),
    ("completions", {"n": 3, "stream": True}),
    ("completions", {"best_of": 3, "n": 2}),
    ("completions", {"echo": True}),
    ("completions", {"stop": ["Z"]}),
    ("chat", {"n": 2}),
    ("chat", {"tools": [WEATHER], "stream": True}),
    ("chat", {"tools": [WEATHER]}),
]
HISTOGRAMS = ["pdserve_coordinator_stage_duration_seconds", "pdserve_coordinator_inter_token_latency_seconds",
              "pdserve_coordinator_time_per_output_token_seconds",
              "pdserve_coordinator_time_to_first_token_seconds", "pdserve_coordinator_request_duration_seconds"]


def sums(app) -> dict[str, float]:
    """Every histogram's ``_sum`` series (by name and labels) and its lowest bucket count."""
    out = {}
    for family in app.deps.metrics.registry.collect():
        for sample in family.samples:
            if any(sample.name == h + "_sum" for h in HISTOGRAMS):
                out[f"{sample.name}{sorted(sample.labels.items())}"] = sample.value
    return out


@pytest.mark.parametrize("pd", [True, False], ids=["pd", "single"])
def test_no_latency_is_ever_negative(loop, stubs, pd):
    engines = ([stubs(role="prefill"), stubs(role="decode", num_tokens=5, token_delay_s=0.01)] if pd
               else [stubs(num_tokens=5, token_delay_s=0.01)])
    with serve(loop, engines) as app:
        for endpoint, extra in SHAPES:
            body = {"model": "tiny", "max_tokens": 5, **extra}
            if endpoint == "chat":
                body["messages"] = [{"role": "user", "content": "hi"}]
            else:
                body["prompt"] = "hello"
            r = httpx.post(f"{app.url}/v1/{'chat/' if endpoint == 'chat' else ''}completions",
                           json=body, timeout=30)
            assert r.status_code == 200, (extra, r.text)
            negative = {k: v for k, v in sums(app).items() if v < 0}
            assert not negative, (endpoint, extra, negative)
        assert sums(app), "no latency was observed"
