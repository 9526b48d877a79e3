"""``wait_event`` never loses a cancellation, even one that arrives as the event is set
(``asyncio.wait_for`` on Python 3.11 can), so a component's loop stops when told."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.runtime.aio import wait_event


def test_a_cancellation_as_the_event_is_set_is_not_lost():
    async def go() -> int:
        lost = 0
        for _ in range(200):
            event = asyncio.Event()
            task = asyncio.ensure_future(wait_event(event, 60))
            await asyncio.sleep(0)
            event.set()
            task.cancel()  # in the same step as the set: the race wait_for loses
            try:
                await task
                lost += 1
            except asyncio.CancelledError:
                pass
        return lost

    assert asyncio.run(go()) == 0


def test_it_says_whether_the_event_was_set():
    async def go():
        event = asyncio.Event()
        assert await wait_event(event, 0.01) is False
        event.set()
        assert await wait_event(event, 10) is True

    asyncio.run(go())


@pytest.mark.parametrize("timeout_s", [0, -1])
def test_no_time_left_returns_at_once(timeout_s):
    assert asyncio.run(wait_event(asyncio.Event(), timeout_s)) is False
