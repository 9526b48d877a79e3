"""A worker's queue loop: items in order until the ``None`` stop, housekeeping only
while idle, and nothing left behind (the worker thread ends, the queue is empty)."""

from __future__ import annotations

import queue
import threading

from pdserve.runtime.queues import items_until_none


def test_a_worker_takes_items_in_order_and_stops_at_none():
    jobs: queue.Queue = queue.Queue()
    for item in ("a", "b", None, "after the stop"):
        jobs.put(item)
    idle: list[int] = []

    assert list(items_until_none(jobs, 0.01, lambda: idle.append(1))) == ["a", "b"]
    assert idle == []  # items were waiting: never idle
    assert jobs.get_nowait() == "after the stop"


def test_an_idle_worker_does_its_housekeeping_until_stopped():
    jobs: queue.Queue = queue.Queue()
    idle = threading.Event()
    taken: list[str] = []

    def worker() -> None:
        taken.extend(items_until_none(jobs, 0.01, idle.set))

    thread = threading.Thread(target=worker)
    thread.start()
    assert idle.wait(5)  # nothing came: on_idle ran on the worker
    jobs.put("job")
    jobs.put(None)
    thread.join(5)

    assert not thread.is_alive()
    assert taken == ["job"]
    assert jobs.empty()
