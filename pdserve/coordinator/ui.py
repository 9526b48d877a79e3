"""The status page: ``/ui`` (plain HTML + JS, no build step), ``/ui/state`` (its JSON), ``/``.

It lists the engines and their addresses, so with an API or admin key configured the
guard (``guard.py``) lets only requests with one of them reach ``/ui`` and ``/ui/*``.

``StatusBoard`` builds the state from what the Coordinator already has: its
settings (model, cluster, routing, fallback and KV mode), the instance registry
(role, health, load, view mode), its own metrics (request, TTFT and TPOT
histograms, read as deltas over a short window so the page shows live values, not
lifetime means), the engines' Stats (KV transfer totals, turned into rates; the KV
transport) and, with a Controller, its view's ``recent_events`` (failovers, role
switches), from which the instances that do not serve (starting, suspect, failed,
with the reason) are read. Engine and Controller reads happen at most once per
``refresh_s`` whatever the number of open pages, each with a short timeout: a slow
engine leaves its row stale, never the page blank.

Invariant: each KV transfer counts once. Both of its engines count it in their
Stats, so transfers, bytes, failures and exposed time are read from the prefill
side only (it also measures the exposed time: prefill end to the last write).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from pathlib import Path

from fastapi import FastAPI
from starlette.responses import FileResponse, JSONResponse, RedirectResponse

from pdserve import __version__
from pdserve.runtime.model_source import resolve_dtype
from pdserve.runtime.security import SecuritySettings

from .engine_errors import EngineCallError
from .lifecycle import Deps

STATIC_DIR = Path(__file__).with_name("ui")
WINDOW_S = 30.0  # live values are means over the last WINDOW_S seconds
REFRESH_S = 1.0  # engine Stats and the Controller view are read at most this often
READ_TIMEOUT_S = 1.0
NUM_EVENTS = 20
MIN_SAMPLE_GAP_S = 0.5
# The Controller's event lines (controller/cluster.py record_event, health.set_health):
# "HH:MM:SS <instance>: <OLD> -> <NEW> (<reason>)", "... <instance>: registered (<pool> pool, ...)",
# "... <instance>: forgotten (...)".
EVENT_RE = re.compile(r"^(?P<time>\S+) (?P<instance>[^\s:]+): (?P<what>.*)$")
HEALTH_RE = re.compile(r"^(?P<old>[A-Z]+) -> (?P<new>[A-Z]+) \((?P<reason>.*)\)$")
REGISTERED_RE = re.compile(r"^registered \((?P<pool>\w+) pool")


def _hist(metric, **labels) -> tuple[float, float]:
    """(count, sum) of one histogram child, read from its samples."""
    count = total = 0.0
    for family in metric.collect():
        for s in family.samples:
            if any(s.labels.get(k) != v for k, v in labels.items()):
                continue
            if s.name.endswith("_count"):
                count += s.value
            elif s.name.endswith("_sum"):
                total += s.value
    return count, total


class InstanceHistory:
    """What the Controller's events say about each instance: its pool and its last
    health state with the reason. Fed every view's ``recent_events`` (a sliding
    window, oldest first, so replaying it is harmless); read by the status page for
    the instances not in the routable view."""

    def __init__(self) -> None:
        self.pools: dict[str, str] = {}
        self.health: dict[str, tuple[str, str, str]] = {}  # instance -> (state, reason, time)

    def apply(self, events: list[str]) -> None:
        for event in events:
            m = EVENT_RE.match(event)
            if m is None:
                continue
            instance, what = m["instance"], m["what"]
            if h := HEALTH_RE.match(what):
                self.health[instance] = (h["new"], h["reason"], m["time"])
            elif r := REGISTERED_RE.match(what):
                self.pools[instance] = r["pool"]
            elif what.startswith("forgotten"):
                self.pools.pop(instance, None)
                self.health.pop(instance, None)

    def not_serving(self, serving: set[str]) -> list[dict]:
        """Instances whose last known state is not READY and that are not in ``serving``."""
        return [{"id": iid, "pool": self.pools.get(iid, ""), "state": state.lower(),
                 "reason": reason, "since": since}
                for iid, (state, reason, since) in sorted(self.health.items())
                if state != "READY" and iid not in serving]


class StatusBoard:
    def __init__(self, deps: Deps, security: SecuritySettings | None = None) -> None:
        self.deps = deps
        self.security = security or SecuritySettings.from_env()
        self._samples: deque[tuple[float, dict]] = deque()
        self._engine_stats: dict[str, object] = {}
        self._events: list[str] = []
        self.history = InstanceHistory()
        self._read_s = 0.0
        self._lock = asyncio.Lock()

    def _counters(self) -> dict:
        m = self.deps.metrics
        out = {"ttft": _hist(m.ttft), "tpot": _hist(m.tpot), "e2e": _hist(m.e2e),
               "kv_stage": _hist(m.stage, stage="kv_transfer")}
        out["requests"] = sum(s.value for f in m.requests.collect() for s in f.samples
                              if s.name.endswith("_total") and s.labels.get("code") == "200")
        stats = [s for s in self._engine_stats.values() if s.role == "prefill"]  # one side only
        out["kv_bytes"] = float(sum(s.kv_transfer_bytes for s in stats))
        out["kv_ok"] = float(sum(s.kv_transfers_ok for s in stats))
        out["kv_failed"] = float(sum(s.kv_transfers_failed for s in stats))
        out["kv_exposed_s"] = sum(s.kv_exposed_s_total for s in stats)
        return out

    async def _refresh(self) -> None:
        """Reads engine Stats and the Controller's events; called by ``state``."""
        async with self._lock:
            if time.monotonic() - self._read_s < REFRESH_S:
                return
            self._read_s = time.monotonic()
            registry = self.deps.registry
            instances = registry.all()

            async def stats(inst):
                try:
                    return inst.instance_id, await registry.engine(inst.address).stats(READ_TIMEOUT_S)
                except EngineCallError:
                    return inst.instance_id, None

            results = await asyncio.gather(*(stats(i) for i in instances))
            # Keep the last good read: a counter that vanished would look like a reset.
            self._engine_stats.update({iid: s for iid, s in results if s is not None})
            for gone in set(self._engine_stats) - {i.instance_id for i in instances}:
                del self._engine_stats[gone]
            # Events come with the Controller's view stream, from whichever replica leads.
            self._events = list(registry.recent_events)[-NUM_EVENTS:]
            self.history.apply(list(registry.recent_events))

    def _rates(self, now: float, counters: dict) -> dict:
        if not self._samples or now - self._samples[-1][0] >= MIN_SAMPLE_GAP_S:
            self._samples.append((now, counters))  # bounded: many open pages add no more
        while len(self._samples) > 2 and now - self._samples[1][0] >= WINDOW_S:
            self._samples.popleft()
        t0, old = self._samples[0]
        span = max(now - t0, 1e-9)

        def mean(key):
            dc, ds = counters[key][0] - old[key][0], counters[key][1] - old[key][1]
            return ds / dc if dc > 0 else None

        dbytes = counters["kv_bytes"] - old["kv_bytes"]
        dok = counters["kv_ok"] - old["kv_ok"]
        return {
            "window_s": round(span, 1),
            "requests_per_s": (counters["requests"] - old["requests"]) / span,
            "ttft_s": mean("ttft"), "tpot_s": mean("tpot"), "e2e_s": mean("e2e"),
            "kv_transfer_s": mean("kv_stage"),
            "kv_bytes_per_s": max(dbytes, 0.0) / span,
            "kv_transfers_per_s": max(dok, 0.0) / span,
            "kv_failed_per_s": max(counters["kv_failed"] - old["kv_failed"], 0.0) / span,
            "kv_exposed_s": (counters["kv_exposed_s"] - old["kv_exposed_s"]) / dok if dok > 0 else None,
        }

    async def state(self) -> dict:
        """Called by ``GET /ui/state`` (the page polls it)."""
        await self._refresh()
        registry = self.deps.registry
        rows = []
        for inst in sorted(registry.all(), key=lambda i: (i.role, i.instance_id)):
            state = "draining" if inst.draining else "ready" if inst.healthy else "unhealthy"
            if inst.suspect_until > time.monotonic():
                state = "suspect"
            rows.append({"id": inst.instance_id, "role": inst.role, "address": inst.address,
                         "state": state, "running": inst.num_running, "waiting": inst.num_waiting,
                         "inflight": inst.num_inflight, "kv_usage": round(inst.kv_usage, 4)})
        counters = self._counters()
        return {"cluster": self._cluster(), "mode": registry.mode,
                "fallback_reason": registry.fallback_reason,
                "view_version": registry.version, "instances": rows,
                "not_serving": self.history.not_serving({r["id"] for r in rows}),
                "requests_total": counters["requests"],
                "live": self._rates(time.monotonic(), counters), "events": self._events,
                "source": "controller" if self.deps.settings.controller else "static"}

    def _cluster(self) -> dict:
        """What this Coordinator serves and how it routes: its settings, plus the KV
        transport its engines report."""
        s = self.deps.settings
        transports = sorted({st.kv_transport for st in self._engine_stats.values()
                             if st.kv_transport and st.kv_transport != "none"})
        return {"name": s.cluster_name, "model": s.model, "served_model_name": s.model_name,
                "dtype": resolve_dtype(s.model, s.dtype),
                "version": __version__, "prefill_policy": s.prefill_policy,
                "decode_policy": s.decode_policy, "fallback_policy": s.fallback_policy,
                "kv_mode": s.kv_mode, "kv_transport": ", ".join(transports)}


def register_ui(app: FastAPI) -> None:
    """Called once by ``create_app``: adds ``/``, ``/ui``, ``/ui/app.js`` and ``/ui/state``."""
    board = StatusBoard(app.state.deps)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui")

    @app.get("/ui", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @app.get("/ui/app.js", include_in_schema=False)
    async def script() -> FileResponse:
        return FileResponse(STATIC_DIR / "app.js", media_type="text/javascript")

    @app.get("/ui/state", include_in_schema=False)
    async def state() -> JSONResponse:
        return JSONResponse(await board.state())
