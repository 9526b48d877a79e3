"""``create_app(settings, ...)``: the Coordinator's ASGI app, with no module-level state.

Routes: POST /v1/completions and /v1/chat/completions (JSON or SSE), GET /v1/models
(with the engines' ``max_model_len``), POST /tokenize and /detokenize (``tokenize.py``),
/health (the process serves), /ready (some route exists: a PD pair whose KV path
passed its probe (``pairs.py``) or, under the hybrid fallback, a hybrid engine;
``?verbose=1`` lists every P/D pair, usable or why not, the engine sessions open
(on the engines' session ports), and where the chat template comes from), /metrics (Prometheus text from this
app's own registry). Every error body is OpenAI's error JSON; pydantic validation
failures are 400 (OpenAI's code for them), not FastAPI's 422. Every error answer,
refusals before routing included (auth, body size, validation, unknown model or
path), is logged on one line with its status and reason and counted once in
``pdserve_coordinator_requests_total`` (``Rejections``). Auth, body limits and
timeouts are the guard's (``guard.py``); connection limits the HTTP server's
(``http_server.py``).

Every request takes one path (``front.CoordinatorApp``): the guard, its route, the
error answers and the access line, in that one place. The routes are declared here
with FastAPI, which writes the OpenAPI document; the two completion routes' POSTs are
served by the front itself (``Completions.handle``), the others by FastAPI's router.

The app owns, through its lifespan, the instance view source (static poller or
Controller watcher), the pair checks, the engines (``engines.Engine``, one per address) and the background aborts.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

from fastapi import FastAPI
from starlette.responses import JSONResponse, Response

from pdserve import __version__
from pdserve.runtime.model_source import resolve_dtype
from pdserve.runtime.security import SecuritySettings

from .admission import Admission
from .discovery import StaticDiscovery
from .errors import ServeError
from .front import COMPLETIONS, CoordinatorApp
from .guard import Guard
from .instances import InstanceRegistry
from .kv_events import KVEventFeeds
from .legs import Aborter
from .lifecycle import Deps
from .metrics import CoordinatorMetrics
from .moves import Mover
from .pairs import PairChecks
from .prefix_index import PrefixIndex
from .prompts import PromptBuilder
from .router import Router
from .schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    HealthStatus,
    ModelList,
)
from .serving import Completions
from .settings import CoordinatorSettings
from .tokenize import register_tokenize
from .ui import register_ui
from .watcher import ControllerWatcher

log = logging.getLogger(__name__)
_ERRORS = {code: {"model": ErrorResponse}
           for code in (400, 401, 404, 408, 413, 429, 502, 503, 504)}


def _completion_responses(model) -> dict:
    return {200: {"model": model, "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            **_ERRORS}


ENDPOINTS = {path: endpoint for path, (endpoint, _) in COMPLETIONS.items()}
"""The ``endpoint`` label of a path; every other path counts as ``other``."""


class Rejections:
    """Logs each error answer on one line (INFO for 4xx, WARNING for 5xx, never a
    traceback) and counts those not counted yet by status. Called by the front
    (``front.CoordinatorApp``) and the guard's refusals, on the event loop, before the
    answer is sent."""

    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self.metrics = metrics

    def record(self, method: str, path: str, err: ServeError) -> None:
        rid = err.headers.get("x-request-id")
        name = rid or "-"  # the client's id, then the Coordinator's (its engines') if other
        if err.request_id is not None and err.request_id != rid:
            name = f"{name} ({err.request_id})"
        verb = "failed" if err.status >= 500 else "rejected"
        log.log(logging.WARNING if err.status >= 500 else logging.INFO, "%s %s %s %s: %d %s: %s",
                verb, name, method, path, err.status, err.code or "-", err.message,
                extra={"request_id": rid})
        if not err.is_counted:
            err.is_counted = True
            self.metrics.requests.labels(ENDPOINTS.get(path, "other"), str(err.status)).inc()

    def on_guard_refusal(self, scope: dict, err: ServeError) -> None:
        self.record(scope["method"], scope["path"], err)


def read_api_key(path: str | None, what: str = "API key") -> str | None:
    if not path:
        return None
    key = Path(path).read_text().strip()
    if not key:
        raise ValueError(f"{what} file {path} is empty")
    return key


def create_app(settings: CoordinatorSettings, *, security: SecuritySettings | None = None,
               registry: InstanceRegistry | None = None, start_view: bool = True,
               pairs: PairChecks | None = None) -> CoordinatorApp:
    """Called by ``pdserve coordinator`` and by tests. ``registry`` with ``start_view=False``
    lets a test feed the instance view by hand; such a view has no pair checks unless
    ``pairs`` is given (a view source always runs them)."""
    security = security or SecuritySettings.from_env()
    metrics = CoordinatorMetrics()
    registry = registry or InstanceRegistry(security, settings.suspect_s)
    if pairs is None and start_view:
        pairs = PairChecks(registry, settings.pair_probe_interval_s, settings.pair_probe_retry_s,
                           settings.pair_probe_timeout_s, settings.pair_probe_concurrency)
    if pairs is not None:
        registry.on_failed = pairs.recheck
    index = PrefixIndex(settings.prefix_index_max_blocks)
    feeds = KVEventFeeds(registry, index, metrics, settings.block_size)  # the engines' prefix-cache events
    mover = Mover(registry, metrics, settings.move_stalled_s, settings.block_size)
    deps = Deps(settings, registry, Router(settings, registry, index, metrics, pairs), metrics,
                Aborter(registry), mover if mover.enabled else None)
    admission = Admission(settings.max_concurrency, settings.max_queue, metrics)
    prompts = PromptBuilder(settings.model)
    served_dtype = resolve_dtype(settings.model, settings.dtype)
    completions = Completions(deps, prompts, admission)
    created = int(time.time())
    rejections = Rejections(metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        source = None
        if start_view and settings.controller:
            source = ControllerWatcher(registry, settings.controller, settings.coordinator_id, security)
        elif start_view:
            source = StaticDiscovery(registry, list(settings.engines), settings.poll_interval_s)
        if source is not None:
            await source.start()
            await feeds.start()
        if pairs is not None:
            await pairs.start()
        await mover.start()
        try:
            yield
        finally:
            await mover.stop()
            if pairs is not None:
                await pairs.stop()
            if source is not None:
                await feeds.stop()
                await source.stop()
            await deps.aborter.close()
            await registry.close()

    guard = Guard(settings.max_body_bytes, read_api_key(settings.api_key_file),
                  rejections.on_guard_refusal,
                  admin_key=read_api_key(settings.admin_key_file, "admin key"),
                  body_timeout_s=settings.http_body_timeout_s)
    app = CoordinatorApp(guard, rejections, completions, title="pdserve Coordinator",
                         version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.deps = deps
    app.state.admission = admission

    # Declared for the OpenAPI document: their POSTs are served by the front
    # (``front.COMPLETIONS``) and never reach these functions.
    @app.post("/v1/completions", response_model=None,
              responses=_completion_responses(CompletionResponse))
    async def v1_completions(body: CompletionRequest) -> None:
        raise AssertionError("served by front.CoordinatorApp")

    @app.post("/v1/chat/completions", response_model=None,
              responses=_completion_responses(ChatCompletionResponse))
    async def v1_chat(body: ChatCompletionRequest) -> None:
        raise AssertionError("served by front.CoordinatorApp")

    @app.get("/v1/models", response_model=ModelList, responses={401: {"model": ErrorResponse}})
    async def v1_models() -> dict:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model",
                                             "created": created, "owned_by": "pdserve",
                                             "max_model_len": registry.max_model_len() or None,
                                             "dtype": served_dtype}]}

    @app.get("/health", response_model=HealthStatus)
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready", response_model=HealthStatus, responses={503: {"model": HealthStatus}})
    async def ready(verbose: bool = False) -> Response:
        pools = registry.pools()
        reason = deps.router.compatible(pools)[2]
        can_hybrid = bool(pools.hybrid) and (
            settings.fallback_policy == "hybrid" or deps.router.is_colocated())
        ok = not reason or can_hybrid
        detail = {"prefill": len(pools.prefill), "decode": len(pools.decode),
                  "hybrid": len(pools.hybrid), "mode": registry.mode,
                  "pd": reason or "ok"}
        body = {"status": "ready" if ok else "not ready", "detail": detail}
        if verbose:
            body["pairs"] = pairs.describe() if pairs is not None else []
            body["pairs_checked"] = pairs is not None
            body["sessions"] = registry.session_transports()
            body["chat_template"] = prompts.template_source
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def prometheus() -> Response:
        pools = registry.pools()
        engine_gauges = (metrics.engine_running, metrics.engine_waiting, metrics.engine_kv_usage)
        for gauge in engine_gauges:
            gauge.clear()  # engines that left the view leave the scrape
        for role in ("prefill", "decode", "hybrid"):
            metrics.instances.labels(role).set(len(getattr(pools, role)))
        for inst in registry.all():
            if inst.routable:
                labels = (inst.instance_id, inst.role)
                metrics.engine_running.labels(*labels).set(inst.num_running)
                metrics.engine_waiting.labels(*labels).set(inst.num_waiting)
                metrics.engine_kv_usage.labels(*labels).set(inst.kv_usage)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    register_tokenize(app, prompts, registry, settings)  # /tokenize, /detokenize
    register_ui(app)  # /ui status page, /ui/state, / -> /ui
    return app
