"""asyncio helpers every component's loops share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Waits until ``event`` is set or ``timeout_s`` passed; True if it is set.

    Not ``asyncio.wait_for(event.wait(), ...)``: on Python 3.11 that can swallow a
    cancellation arriving just as the event is set, so a loop cancelled then (a
    component shutting down) runs, and waits, once more."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((waiter,), timeout=max(0.0, timeout_s))
    finally:
        waiter.cancel()
    return event.is_set()


async def gather_limited(items: Iterable, call: Callable[..., Awaitable], limit: int) -> list:
    """``await call(item)`` for every item, at most ``limit`` at once; the results in
    item order, an exception in place of a result (every call runs to its end: the
    caller decides what a failure means once it knows what the others did)."""
    semaphore = asyncio.Semaphore(limit)

    async def one(item):
        async with semaphore:
            return await call(item)

    return await asyncio.gather(*(one(item) for item in items), return_exceptions=True)
