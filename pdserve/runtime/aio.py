"""asyncio helpers every component's loops share."""

from __future__ import annotations

import asyncio


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
