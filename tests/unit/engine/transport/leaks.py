"""The leak check every transport test ends with: no transport thread outlives close()."""

from __future__ import annotations

import threading
import time


def kv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kv-")]


def assert_kv_threads_gone(limit_s: float = 5.0) -> None:
    """Wait up to ``limit_s`` for every kv- thread (accept, serve, send, recv) to exit."""
    deadline = time.monotonic() + limit_s
    while kv_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not kv_threads(), "transport threads outlived close()"
