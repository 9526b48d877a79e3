"""Process plumbing every component's CLI shares: a small aiohttp side server
(metrics, probes) and waiting for SIGINT/SIGTERM.

``start_http`` returns the bound port, so ``port=0`` works for tests and local mode.
"""

from __future__ import annotations

import asyncio
import signal

from aiohttp import web


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
