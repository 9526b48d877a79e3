"""The engine's Prometheus metrics (``pdserve_engine_*``) and their HTTP endpoint.

Two sources, one explicit registry per engine process:

- load and token totals come from the loop's ``snapshot`` (``LLMEngine.stats()``
  published after every step), so a scrape never races a step and never waits for one;
- KV transfers are observed one by one through the connector's transfer-done hook
  (``observe_transfer``, called on the engine thread for every finished transfer):
  bytes, duration, failures and exposed (not hidden behind prefill) time, by mode,
  transport and the engine's side of the transfer; and refusals for want of D's
  blocks ("decode full": load, so never counted as failures), by side.

And the process's garbage-collector pauses (``pdserve_engine_gc_pause_seconds``,
``runtime/gc_tuning.py``): every thread of the engine stops for each.

Labels are bounded: role (prefill | decode | hybrid), mode (pull | push | layerwise),
transport (tcp | shm | mooncake). On the load gauges ``role`` is the engine's role; on
transfer metrics it is the engine's side of that transfer (prefill sends, decode
receives; a hybrid engine may take either). Never request or transfer ids.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.engine.kv_transfer.params import KV_ROLES, MODES
from pdserve.runtime import gc_tuning
from pdserve.runtime.http import start_http

log = logging.getLogger(__name__)

# KV transfers on one host take ~1 ms; over a slow network, seconds.
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class StatsCollector:
    """Renders the last ``StatsResponse`` snapshot; ``snapshot`` is set before each scrape."""

    def __init__(self) -> None:
        self.snapshot = None

    def collect(self):
        s = self.snapshot
        if s is None:
            return
        p, role = "pdserve_engine_", [s.role]
        transport = s.kv_transport
        info = GaugeMetricFamily(p + "info", "The engine's role, model and KV transport (1).",
                                 labels=["role", "model", "transport"])
        info.add_metric([s.role, s.model, transport], 1.0)
        yield info
        for name, doc, value in (
            ("running_requests", "Requests in the running batch.", s.num_running),
            ("waiting_requests", "Requests waiting to be scheduled.", s.num_waiting),
            ("kv_cache_used_blocks", "KV cache blocks in use.", s.num_kv_blocks_used),
            ("kv_cache_free_blocks", "KV cache blocks free.", s.num_kv_blocks_free),
            ("kv_transfers_active", "KV transfers in flight.", s.num_kv_transfers_active),
        ):
            g = GaugeMetricFamily(p + name, doc, labels=["role"])
            g.add_metric(role, float(value))
            yield g
        ratio = s.prefix_cache_hit_tokens / s.prefix_cache_query_tokens \
            if s.prefix_cache_query_tokens else 0.0
        g = GaugeMetricFamily(p + "prefix_cache_hit_ratio", "Prefix cache hit tokens over "
                              "queried tokens since start.", labels=["role"])
        g.add_metric(role, ratio)
        yield g
        for name, doc, value in (
            ("prompt_tokens", "Prompt tokens prefilled.", s.num_prompt_tokens_total),
            ("generation_tokens", "Tokens generated.", s.num_generation_tokens_total),
            ("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_query_tokens),
            ("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.",
             s.prefix_cache_hit_tokens),
            ("preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions),
        ):
            c = CounterMetricFamily(p + name, doc, labels=["role"])
            c.add_metric(role, float(value))
            yield c
        if s.kv_pool_enabled:
            yield from _pool_metrics(s, role)


def _pool_metrics(s, role: list[str]):
    """The shared KV pool as this engine sees it (``engine/kv_pool.py``)."""
    p = "pdserve_engine_kv_pool_"
    up = GaugeMetricFamily(p + "up", "Whether the KV pool answers (1) or is treated as down.",
                           labels=["role"])
    up.add_metric(role, float(s.kv_pool_up))
    yield up
    for name, doc, value in (
        ("lookup_blocks", "Blocks looked up in the pool after a local prefix-cache miss.",
         s.kv_pool_lookup_blocks),
        ("hit_blocks", "Blocks fetched from the pool instead of computed.", s.kv_pool_hit_blocks),
        ("put_blocks", "Blocks put into the pool.", s.kv_pool_put_blocks),
        ("fetched_bytes", "Bytes fetched from the pool.", s.kv_pool_fetched_bytes),
        ("put_bytes", "Bytes put into the pool.", s.kv_pool_put_bytes),
        ("put_dropped_blocks", "Blocks not put (too many waiting, or the pool failed).",
         s.kv_pool_put_dropped),
    ):
        c = CounterMetricFamily(p + name, doc, labels=["role"])
        c.add_metric(role, float(value))
        yield c


class EngineMetrics:
    def __init__(self, transport: str) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        gc_tuning.register_pauses(r, "engine")
        p = "pdserve_engine_kv_transfer_"
        labels = ["mode", "transport", "role"]
        self.stats = StatsCollector()
        r.register(self.stats)
        self.transfer_bytes = Counter(p + "bytes", "KV bytes moved by finished transfers.",
                                      labels, registry=r)
        self.transfer_failures = Counter(p + "failures", "KV transfers that failed or were "
                                         "aborted (refusals excepted).", labels, registry=r)
        self.reserve_refused = Counter("pdserve_engine_kv_reserve_refused", "KV transfers "
                                       "refused because D had no free blocks within its "
                                       "reserve wait (\"decode full\"); role: this engine's "
                                       "side (decode refused, prefill was refused).",
                                       ["role"], registry=r)
        self.transfer_duration = Histogram(p + "duration_seconds", "Successful KV transfers, "
                                           "start to settled.", labels, buckets=TRANSFER_BUCKETS,
                                           registry=r)
        self.transfer_exposed = Histogram(p + "exposed_seconds", "Prefill side: time from the "
                                          "end of prefill to every KV write settled, i.e. the "
                                          "transfer time not hidden behind compute.",
                                          ["mode", "transport"], buckets=TRANSFER_BUCKETS,
                                          registry=r)
        self.transport = transport
        if transport != "none":  # every series exists from the start: rate() works at once
            for role in KV_ROLES:
                self.reserve_refused.labels(role)
            for mode in MODES:
                self.transfer_exposed.labels(mode, transport)
                for role in KV_ROLES:
                    for m in (self.transfer_bytes, self.transfer_failures, self.transfer_duration):
                        m.labels(mode, transport, role)

    def observe_transfer(self, xfer, ok: bool) -> None:
        """Called on the engine thread by the connector for every finished transfer."""
        params = xfer.params
        key = (params.mode, self.transport, params.role)
        if not ok:
            if xfer.is_full:
                self.reserve_refused.labels(params.role).inc()
            elif not xfer.is_cancelled:
                self.transfer_failures.labels(*key).inc()
            return
        now = time.monotonic()
        self.transfer_bytes.labels(*key).inc(sum(h.num_bytes for h in xfer.handles))
        self.transfer_duration.labels(*key).observe(now - xfer.started_s)
        if params.role == "prefill" and xfer.prefill_done_s is not None:
            self.transfer_exposed.labels(params.mode, self.transport).observe(now - xfer.prefill_done_s)

    def render(self, stats) -> bytes:
        self.stats.snapshot = stats
        return generate_latest(self.registry)


def attach_metrics(engine) -> EngineMetrics:
    """Called once by the server before the engine thread starts: builds the metrics and
    subscribes ``observe_transfer`` to every finished KV transfer."""
    connector = engine.connector
    metrics = EngineMetrics(connector.transport_name if connector else "none")
    if connector is not None:
        connector.add_observer(metrics.observe_transfer)
    return metrics


async def start_metrics_server(loop, metrics: EngineMetrics, host: str,
                               port: int) -> tuple[web.AppRunner, int]:
    """Serve ``GET /metrics`` on ``host:port`` (0: a free port); returns the runner and port."""

    async def scrape(_request):
        stats = loop.snapshot  # published after every step; a long step delays nothing here
        return web.Response(body=metrics.render(stats), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", scrape)
    return await start_http(app, host, port)
