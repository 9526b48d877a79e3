"""Log lines that repeat, at most once per key per interval, with a count of the rest.

An engine that refuses or fails every leg (a wrong cluster token, a crash loop, a
full KV cache) would otherwise write one line per request. ``ThrottledLog`` writes
the first line of a key (the Coordinator uses engine, leg and reason), holds back
the same key's lines for ``interval_s`` and says how many it held back in the next
line it writes for that key.

Called on the event loop only (no lock). Memory is bounded: keys are engine
addresses times short reason labels, and past ``MAX_KEYS`` the oldest are dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

MAX_KEYS = 1024


class ThrottledLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._seen: dict[Hashable, tuple[float, int]] = {}  # key -> (last written, held back)

    def log(self, level: int, key: Hashable, msg: str, *args) -> bool:
        """Writes ``msg % args`` unless ``key`` was written less than ``interval_s``
        ago; returns whether it wrote."""
        now = self._clock()
        last = self._seen.get(key)
        if last is not None and now - last[0] < self.interval_s:
            self._seen[key] = (last[0], last[1] + 1)
            return False
        if last is not None and last[1]:
            msg += " (%d more like it in the last %.0fs)"
            args = (*args, last[1], now - last[0])
        self._seen.pop(key, None)
        self._seen[key] = (now, 0)  # newest last: the first ones are the oldest
        while len(self._seen) > MAX_KEYS:
            del self._seen[next(iter(self._seen))]
        self.logger.log(level, msg, *args)
        return True
