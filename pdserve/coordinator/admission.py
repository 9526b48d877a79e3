"""Admission control: at most ``max_concurrency`` requests served, ``max_queue`` waiting.

A request beyond both is refused at once with 429 and ``Retry-After``; a queued
request waits for a slot until its deadline (then 429 as well). Slots are released
exactly once (``Slot.release`` is idempotent), whoever ends the request. The gauges
of requests served and waiting read ``num_running`` and ``num_waiting`` when rendered.
"""

from __future__ import annotations

import asyncio
import math
import time

from .errors import ServeError
from .metrics import CoordinatorMetrics


class Slot:
    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._held = True

    def release(self) -> None:
        """Called by the app when the response (or stream) has ended; idempotent."""
        if self._held:
            self._held = False
            self._admission._release()


class Admission:
    def __init__(self, max_concurrency: int, max_queue: int, metrics: CoordinatorMetrics) -> None:
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.metrics = metrics
        self.num_running = 0
        self.num_waiting = 0
        self._waiters: list[asyncio.Future] = []
        self._mean_s = 1.0  # EWMA of request durations, for Retry-After
        metrics.inflight.set_function(lambda: self.num_running)
        metrics.queued.set_function(lambda: self.num_waiting)

    def _retry_after(self) -> dict[str, str]:
        backlog = (self.num_waiting + 1) / max(1, self.max_concurrency)
        return {"Retry-After": str(max(1, math.ceil(self._mean_s * backlog)))}

    async def acquire(self, deadline: float) -> Slot:
        """Called by the app before serving a request; raises 429 when full."""
        if self.num_running < self.max_concurrency and not self._waiters:
            self._enter()
            return Slot(self)
        if self.num_waiting >= self.max_queue:
            self.metrics.rejected.labels("queue_full").inc()
            raise ServeError(429, "too many requests: the Coordinator's queue is full",
                             code="queue_full", headers=self._retry_after())
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self.num_waiting += 1
        try:
            await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            self.metrics.rejected.labels("queue_timeout").inc()
            raise ServeError(429, "too many requests: no slot within the deadline",
                             code="queue_timeout", headers=self._retry_after()) from None
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._release()  # handed a slot while being cancelled: pass it on
            raise
        finally:
            self.num_waiting -= 1
            if fut in self._waiters:
                self._waiters.remove(fut)
        return Slot(self)

    def _enter(self) -> None:
        self.num_running += 1

    def _release(self) -> None:
        self.num_running -= 1
        while self._waiters:
            fut = self._waiters.pop(0)
            if not fut.done():
                self._enter()  # the slot passes straight to the oldest waiter
                fut.set_result(None)
                return

    def observe_duration(self, seconds: float) -> None:
        self._mean_s = 0.9 * self._mean_s + 0.1 * seconds
