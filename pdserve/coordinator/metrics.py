"""The Coordinator's Prometheus metrics, on one explicit registry per app.

Names are ``pdserve_coordinator_<what>_<unit>``. Labels are bounded: endpoints and
stages are fixed sets, status codes are HTTP codes, reasons are the router's and
lifecycle's short labels (never free text, request ids or addresses).

Every metric is observed and rendered (``/metrics``) on the event loop, a few times
per request, so the per-request ones skip prometheus_client's locks: the histograms
(stages, TTFT, TPOT, end to end, and the inter-token latency, observed per output
token) are ``LoopHistogram``s (``runtime/loop_histogram.py``), the same series as
prometheus_client's ``Histogram`` without its two locked increments per observation
(nor ``_created``); the counters are ``LoopCounter``s, prometheus_client's ``Counter``
(the same series) whose value is a plain float, not a locked one, and the labelled
ones ``KeptCounter``s, whose ``labels`` finds a child it made before in a dict
(prometheus_client's takes a lock and builds the value tuple per call). The registry
also renders the process's garbage-collector pauses
(``pdserve_coordinator_gc_pause_seconds``, ``runtime/gc_tuning.py``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pdserve.runtime import gc_tuning
from pdserve.runtime.loop_histogram import LoopHistogram

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
        gc_tuning.register_pauses(r, "coordinator")
        p = "pdserve_coordinator_"
        self.requests = KeptCounter(p + "requests_total", "Finished HTTP requests.",
                                    ["endpoint", "code"], registry=r)
        self.fallbacks = KeptCounter(p + "fallbacks_total", "Requests that met an empty pool, "
                                     "by fallback policy and reason.", ["policy", "reason"],
                                     registry=r)
        self.retries = KeptCounter(p + "retries_total", "Legs retried after a failure.",
                                   ["leg", "stage"], registry=r)
        self.continuations = LoopCounter(p + "continuations_total", "Streams continued on a new "
                                     "pair after the decode engine failed mid-stream.", registry=r)
        self.moves = LoopCounter(p + "moves_total", "Streams moved off a decode engine that "
                                 "queues requests, or has twice the legs of another, to one with room "
                                 "(``moves.py``).", registry=r)
        self.overloads = KeptCounter(p + "overload_total", "Legs an engine refused for want "
                                     "of room (\"decode full\", \"prefill full\"): load, not "
                                     "failures.", ["leg"], registry=r)
        self.rejected = KeptCounter(p + "rejected_total", "Requests refused by admission control.",
                                    ["reason"], registry=r)
        self.local_prefills = LoopCounter(p + "local_prefills_total", "Requests run on one engine "
                                      "by conditional disaggregation.", registry=r)
        self.prefill_decisions = KeptCounter(
            p + "prefill_decisions_total", "Where a PD request's prompt was prefilled (decode: "
            "conditional disaggregation), by the reason.", ["where", "reason"], registry=r)
        self.aborts = KeptCounter(p + "aborts_total", "Requests ended early (client gone, "
                                  "deadline, stop string), both legs aborted.", ["reason"],
                                  registry=r)
        self.prompt_tokens = LoopCounter(p + "prompt_tokens_total", "Prompt tokens.", registry=r)
        self.generation_tokens = LoopCounter(p + "generation_tokens_total", "Output tokens.", registry=r)
        self.inflight = Gauge(p + "inflight_requests", "Requests being served.", registry=r)
        self.queued = Gauge(p + "queued_requests", "Requests waiting for admission.", registry=r)
        self.queued_for_route = Gauge(p + "route_waiting_requests", "Requests waiting for an "
                                      "engine pool (fallback policy queue).", registry=r)
        self.instances = Gauge(p + "instances", "Routable engines by role.", ["role"], registry=r)
        self.engine_running = Gauge(p + "engine_running_requests", "Requests each routable engine "
                                    "runs, as it last reported.", ["instance", "role"], registry=r)
        self.engine_waiting = Gauge(p + "engine_waiting_requests", "Requests queued in each "
                                    "routable engine, as it last reported.", ["instance", "role"],
                                    registry=r)
        self.engine_kv_usage = Gauge(p + "engine_kv_usage_ratio", "Share of each routable "
                                     "engine's KV blocks in use, as it last reported.",
                                     ["instance", "role"], registry=r)
        self.stage = LoopHistogram(p + "stage_duration_seconds", "Per-request stage durations "
                                   "reported by the engines.", LATENCY_BUCKETS, r,
                                   labelnames=("stage",), series=[(s,) for s in STAGES])
        self.ttft = LoopHistogram(p + "time_to_first_token_seconds", "Arrival to first token.",
                                  LATENCY_BUCKETS, r)
        self.tpot = LoopHistogram(p + "time_per_output_token_seconds", "Mean gap between "
                                  "output tokens after the first.", LATENCY_BUCKETS, r)
        self.e2e = LoopHistogram(p + "request_duration_seconds", "Arrival to last token.",
                                 LATENCY_BUCKETS, r)
        self.itl = LoopHistogram(p + "inter_token_latency_seconds", "Gap between consecutive "
                                 "output tokens of a stream.", LATENCY_BUCKETS, r)
        self.routes = KeptCounter(p + "routing_decisions_total", "Engines chosen, by pool and "
                                  "the policy that chose them.", ["pool", "policy"], registry=r)
        self.prefix_predicted = LoopCounter(
            p + "prefix_predicted_tokens_total", "Prompt tokens the prefix index expected the "
            "prefilling engine to find in its cache, at routing.", registry=r)
        self.prefix_reported = LoopCounter(
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


class _LoopValue:
    """A counter's value on the event loop: prometheus_client's value interface
    without its lock (``inc``, ``set``, ``get``, exemplars)."""

    __slots__ = ("_value", "_exemplar")

    def __init__(self) -> None:
        self._value = 0.0
        self._exemplar = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def get(self) -> float:
        return self._value

    def set_exemplar(self, exemplar) -> None:
        self._exemplar = exemplar

    def get_exemplar(self):
        return self._exemplar


class LoopCounter(Counter):
    """prometheus_client's ``Counter`` (the same series), its value without a lock:
    incremented and rendered on the event loop only."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = _LoopValue()

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        if exemplar is not None or amount < 0 or (self._labelnames and not self._labelvalues):
            return super().inc(amount, exemplar)  # its checks and errors
        self._value._value += amount


class KeptCounter(LoopCounter):
    """prometheus_client's ``Counter`` (the same series) whose ``labels`` keeps each
    child it returned in a dict of the values as given: a label set seen before costs
    one look-up. Label values are bounded sets (the module's docstring), so is the dict."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kept: dict[tuple, LoopCounter] = {}

    def labels(self, *values: object, **by_name: object) -> LoopCounter:
        if by_name:
            return super().labels(*values, **by_name)
        child = self._kept.get(values)
        if child is None:
            child = self._kept[values] = super().labels(*values)
        return child


