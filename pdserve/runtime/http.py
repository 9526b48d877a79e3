"""Process plumbing every component's CLI shares: the HTTP side server (metrics,
probes) and the run sequence of a component process.

- ``create_side_app(registry, probes)``: ``GET /metrics`` renders ``registry`` at
  scrape time; each probe path answers 200 with the probe's text when it is ok,
  else 503 with its text. ``alive`` is the probe of a process whose loop runs.
- ``start_http(app, host, port)``: serve an app; returns the bound port, so
  ``port=0`` works for tests and local mode.
- ``run_component(component, side_app, host, port, banner)``: a component
  process's whole life, from side server up to a clean stop on SIGINT/SIGTERM.

Self-contained: aiohttp, prometheus_client and the standard library only.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

Probe = Callable[[], tuple[bool, str]]
"""A probe: (is_ok, response text). Called on the event loop for every request; no I/O."""


def alive() -> tuple[bool, str]:
    """The ``/healthz`` probe: answering at all means the process's loop runs."""
    return True, "ok\n"


class Component(Protocol):
    """What ``run_component`` drives: the Controller, the NodeAgent."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def registry_of(*collectors) -> CollectorRegistry:
    """A registry of its own holding ``collectors`` (read at scrape time)."""
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    return registry


def create_side_app(registry: CollectorRegistry, probes: Mapping[str, Probe]) -> web.Application:
    """``/metrics`` from ``registry`` plus one GET route per probe path."""

    async def metrics(_):
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    def answer(probe: Probe):
        async def handler(_):
            is_ok, text = probe()
            return web.Response(status=200 if is_ok else 503, text=text)
        return handler

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    for path, probe in probes.items():
        app.router.add_get(path, answer(probe))
    return app


async def start_http(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (0: a free port); returns the runner and the port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def wait_for_stop_signal() -> None:
    """Return on the first SIGINT or SIGTERM; called by a CLI's main coroutine."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def run_component(component: Component, side_app: web.Application, host: str, http_port: int,
                        banner: Callable[[int], str], *,
                        after_stop: Callable[[], Awaitable[object]] | None = None) -> int:
    """Called by a component CLI's ``serve``: serve ``side_app`` on ``host:http_port``,
    start ``component``, print ``banner(bound http port)`` (``pdserve up`` and the tests
    wait for that line), wait for SIGINT/SIGTERM, stop the component, await
    ``after_stop`` (the Controller's gRPC server), close the side server. Returns 0."""
    runner, bound_port = await start_http(side_app, host, http_port)
    await component.start()
    print(banner(bound_port), flush=True)
    await wait_for_stop_signal()
    await component.stop()
    if after_stop is not None:
        await after_stop()
    await runner.cleanup()
    return 0
