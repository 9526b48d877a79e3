"""Revocable write grants: which peer may write where, and a fence when that ends.

The decode engine grants a prefill peer the byte ranges of the blocks it reserved for
one transfer and revokes the grant when the transfer ends. A transport that enforces
grants (tcp) refuses any write outside a live grant, and ``revoke`` returns only once
no write under the grant can land: a frame already landing in a revoked range is cut
off by shutting its connection down, and ``revoke`` waits for it to stop. That is
what lets D free the blocks of an aborted transfer at once, even when P is stopped
mid-write, instead of holding them until P answers.

Invariant: a write is checked and registered as in flight under one lock, so a
revoke either sees it in flight or it sees the grant gone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np


class WriteGrants:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._by_tag: dict[str, tuple[str, np.ndarray]] = {}  # tag -> (peer, [n, 2] ranges)
        self._in_flight: dict[int, tuple[str, np.ndarray, object]] = {}  # id -> (peer, ranges, conn)
        self._next_id = 0

    def grant(self, peer: str, tag: str, ranges: np.ndarray) -> None:
        with self._cond:
            self._by_tag[tag] = (peer, np.asarray(ranges, dtype=np.int64).reshape(-1, 2))

    def begin_write(self, peer: str, addrs: np.ndarray, lengths: np.ndarray, conn) -> int | str:
        """Check a write against the peer's live grants and mark it in flight.

        Returns a token for ``end_write``, or a message saying why it is refused.
        """
        with self._cond:
            mine = [r for p, r in self._by_tag.values() if p == peer]
            if not mine:
                return f"no write grant for peer {peer}"
            starts, ends = _merged(np.concatenate(mine))
            # A coalesced write may span neighbouring granted blocks: test against the
            # union of the peer's grants, merged into disjoint runs.
            idx = np.searchsorted(starts, addrs, side="right") - 1
            inside = (idx >= 0) & (addrs + lengths <= ends[np.maximum(idx, 0)]) & (lengths >= 0)
            if not inside.all():
                bad = int(np.flatnonzero(~inside)[0])
                return f"write [{int(addrs[bad]):#x}, +{int(lengths[bad])}) is outside {peer}'s grants"
            self._next_id += 1
            spans = np.stack([addrs, lengths], axis=1)
            self._in_flight[self._next_id] = (peer, spans, conn)
            return self._next_id

    def end_write(self, token: int) -> None:
        with self._cond:
            self._in_flight.pop(token, None)
            self._cond.notify_all()

    def revoke(self, tag: str, cut: Callable[[object], None], timeout_s: float = 2.0) -> bool:
        """End a grant; True once no write under it can land any more."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            entry = self._by_tag.pop(tag, None)
            if entry is None:
                return True
            peer, ranges = entry
            while True:
                landing = [t for t, (p, spans, _) in self._in_flight.items()
                           if p == peer and _overlaps(spans, ranges)]
                if not landing:
                    return True
                for t in landing:
                    cut(self._in_flight[t][2])  # its reader wakes with an error and stops
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))


def _merged(ranges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted disjoint (starts, ends) covering the union of [addr, addr+length) ranges."""
    order = np.argsort(ranges[:, 0], kind="stable")
    starts, ends = ranges[order, 0], ranges[order, 0] + ranges[order, 1]
    reach = np.maximum.accumulate(ends)
    new_run = np.concatenate(([True], starts[1:] > reach[:-1]))
    run_id = np.cumsum(new_run) - 1
    run_ends = np.zeros(int(run_id[-1]) + 1, dtype=np.int64)
    np.maximum.at(run_ends, run_id, reach)
    return starts[new_run], run_ends


def _overlaps(spans: np.ndarray, ranges: np.ndarray) -> bool:
    for base, size in ranges:
        if np.any((spans[:, 0] < base + size) & (spans[:, 0] + spans[:, 1] > base)):
            return True
    return False
