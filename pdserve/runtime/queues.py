"""The loop of a worker thread that serves a ``queue.Queue``.

A worker takes items until its owner puts ``None`` (the stop), and does its
housekeeping (a health check, a sweep of stale sockets) whenever no item came for a
while. ``items_until_none`` is that loop once, so each worker writes only what it
does with an item.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


def items_until_none(jobs: queue.Queue[T | None], idle_s: float | Callable[[], float | None],
                     on_idle: Callable[[], None]) -> Iterator[T]:
    """The items of ``jobs`` as they come, until a ``None``; ``on_idle`` runs on this
    thread whenever no item came for ``idle_s`` (a callable: asked before each wait;
    None waits for the next item however long). Called by the worker thread only."""
    while True:
        try:
            item = jobs.get(timeout=idle_s() if callable(idle_s) else idle_s)
        except queue.Empty:
            on_idle()
            continue
        if item is None:
            return
        yield item
