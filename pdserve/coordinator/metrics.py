"""The Coordinator's Prometheus metrics, on one explicit registry per app.

Names are ``pdserve_coordinator_<what>_<unit>``. Labels are bounded: endpoints and
stages are fixed sets, status codes are HTTP codes, reasons are the router's and
lifecycle's short labels (never free text, request ids or addresses).

Every metric is observed and rendered (``/metrics``) on the event loop. The one
observed per output token, the inter-token latency, is a ``LoopHistogram``: the same
series as prometheus_client's ``Histogram`` without its two locked increments per
observation.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0)
STAGES = ("route", "prefill_queue", "prefill_compute", "kv_transfer", "decode_wait",
          "decode_queue", "first_decode")
# Every label value these counters take (router, lifecycle, admission, serving). Their
# series are created at zero, so dashboards and alerts see 0 (not "no data") until the
# first event, and rate() counts that first event.
REJECT_REASONS = ("queue_full", "queue_timeout")
FALLBACK_POLICIES = ("hybrid", "queue", "fail")
FALLBACK_REASONS = ("no_prefill_or_decode_engine", "no_prefill_engine", "no_decode_engine",
                    "no_compatible_pair")
RETRY_LEGS = {"prefill": ("before_handoff",), "decode": ("before_first_token", "mid_stream"),
              "single": ("before_first_token", "mid_stream")}
ABORT_REASONS = ("client_gone", "stop_string")
LEGS = ("prefill", "decode", "single")


class CoordinatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "pdserve_coordinator_"
        self.requests = Counter(p + "requests_total", "Finished HTTP requests.",
                                ["endpoint", "code"], registry=r)
        self.fallbacks = Counter(p + "fallbacks_total", "Requests that met an empty pool, by "
                                 "fallback policy and reason.", ["policy", "reason"], registry=r)
        self.retries = Counter(p + "retries_total", "Legs retried after a failure.",
                               ["leg", "stage"], registry=r)
        self.continuations = Counter(p + "continuations_total", "Streams continued on a new "
                                     "pair after the decode engine failed mid-stream.", registry=r)
        self.overloads = Counter(p + "overload_total", "Legs an engine refused for want of "
                                 "room (\"decode full\", \"prefill full\"): load, not failures.",
                                 ["leg"], registry=r)
        self.rejected = Counter(p + "rejected_total", "Requests refused by admission control.",
                                ["reason"], registry=r)
        self.local_prefills = Counter(p + "local_prefills_total", "Requests run on one engine "
                                      "by conditional disaggregation.", registry=r)
        self.prefill_decisions = Counter(
            p + "prefill_decisions_total", "Where a PD request's prompt was prefilled (decode: "
            "conditional disaggregation), by the reason.", ["where", "reason"], registry=r)
        self.aborts = Counter(p + "aborts_total", "Requests ended early (client gone, deadline, "
                              "stop string), both legs aborted.", ["reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens_total", "Output tokens.", registry=r)
        self.inflight = Gauge(p + "inflight_requests", "Requests being served.", registry=r)
        self.queued = Gauge(p + "queued_requests", "Requests waiting for admission.", registry=r)
        self.queued_for_route = Gauge(p + "route_waiting_requests", "Requests waiting for an "
                                      "engine pool (fallback policy queue).", registry=r)
        self.instances = Gauge(p + "instances", "Routable engines by role.", ["role"], registry=r)
        self.stage = Histogram(p + "stage_duration_seconds", "Per-request stage durations "
                               "reported by the engines.", ["stage"], buckets=LATENCY_BUCKETS,
                               registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Mean gap between output "
                              "tokens after the first.", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "request_duration_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.itl = LoopHistogram(p + "inter_token_latency_seconds", "Gap between consecutive "
                                 "output tokens of a stream.", LATENCY_BUCKETS, r)
        self.routes = Counter(p + "routing_decisions_total", "Engines chosen, by pool and "
                              "the policy that chose them.", ["pool", "policy"], registry=r)
        self.prefix_predicted = Counter(
            p + "prefix_predicted_tokens_total", "Prompt tokens the prefix index expected the "
            "prefilling engine to find in its cache, at routing.", registry=r)
        self.prefix_reported = Counter(
            p + "prefix_reported_tokens_total", "Prompt tokens the prefilling engines reported "
            "they found in their cache.", registry=r)
        self.kv_event_streams = Gauge(p + "kv_event_streams", "Engines whose prefix-cache "
                                      "events feed the prefix index.", registry=r)
        self._stage_children = {s: self.stage.labels(s) for s in STAGES}
        self._create_series()

    def _create_series(self) -> None:
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for policy in FALLBACK_POLICIES:
            for reason in FALLBACK_REASONS:
                self.fallbacks.labels(policy, reason)
        for leg, stages in RETRY_LEGS.items():
            for stage in stages:
                self.retries.labels(leg, stage)
        for reason in ABORT_REASONS:
            self.aborts.labels(reason)
        for leg in LEGS:
            self.overloads.labels(leg)
        for role in ("prefill", "decode", "hybrid"):
            self.instances.labels(role)

    def observe_stage(self, stage: str, seconds: float) -> None:
        self._stage_children[stage].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LoopHistogram:
    """A histogram without labels, observed and collected on the event loop only, so
    without locks: ``observe`` is a bisection and two additions. Renders as
    prometheus_client's ``Histogram`` (``_bucket`` with ``le``, ``_count``, ``_sum``)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = [*buckets, float("inf")]
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self._sum = 0.0
        registry.register(self)

    def observe(self, amount: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, amount)] += 1
        self._sum += amount

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative, total = [], 0
        for bound, count in zip(self._bounds, self._counts, strict=True):
            total += count
            cumulative.append((floatToGoString(bound), total))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=cumulative,
                                    sum_value=self._sum)
