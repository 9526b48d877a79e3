"""The prefix cache's events, for routers: which blocks this engine holds, by hash.

``BlockManager`` calls ``stored`` when a block's hash becomes findable in its prefix
cache and ``removed`` when it stops being findable (its block reused for other
content, or the cache reset), on the engine loop thread or the KV connector's.
``KVEvents`` streams (``server.py``) read them on the asyncio loop with ``read``.

Each event gets the next sequence number; the last ``max_events`` are kept, so a
reader that resumes within them (same ``epoch``, ``since_seq`` not older) gets only
what happened since, and any other reader a snapshot first: every hash the cache
holds now. ``epoch`` is new each engine start, so a Coordinator that sees a new one
knows the engine restarted with an empty cache.

Cost: O(1) per event under a lock; a waiting reader is woken once per burst (the
first event after its last read), not once per event.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

STORED, REMOVED = True, False


@dataclass
class EventBatch:
    epoch: str
    seq: int
    snapshot: bool
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


class KVEventLog:
    def __init__(self, max_events: int = 65536) -> None:
        self.epoch = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._seq = 0
        self._events: deque[tuple[int, bool, bytes]] = deque(maxlen=max_events)
        self._held: set[bytes] = set()
        self._wakers: dict[int, Callable[[], None]] = {}
        self._idle: set[int] = set()  # readers woken by the next event
        self._next_reader = 0

    # -- writers (the block manager) -------------------------------------------

    def stored(self, block_hash: bytes) -> None:
        self._add(STORED, block_hash)

    def removed(self, block_hash: bytes) -> None:
        self._add(REMOVED, block_hash)

    def _add(self, kind: bool, block_hash: bytes) -> None:
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, kind, block_hash))
            if kind is STORED:
                self._held.add(block_hash)
            else:
                self._held.discard(block_hash)
            woken = [self._wakers[r] for r in self._idle]
            self._idle.clear()
        for wake in woken:
            wake()

    # -- readers (KVEvents streams) ----------------------------------------------

    def subscribe(self, wake: Callable[[], None]) -> int:
        """A reader id; ``wake`` (thread-safe) is called once after its next read when
        an event arrives."""
        with self._lock:
            self._next_reader += 1
            self._wakers[self._next_reader] = wake
            return self._next_reader

    def unsubscribe(self, reader: int) -> None:
        with self._lock:
            self._wakers.pop(reader, None)
            self._idle.discard(reader)

    def read(self, reader: int, epoch: str, since_seq: int) -> EventBatch | None:
        """What ``reader`` has not seen after (``epoch``, ``since_seq``): the events since,
        a snapshot when they are no longer kept (or another epoch), None when nothing
        is new (the reader is then woken by the next event)."""
        with self._lock:
            oldest = self._events[0][0] if self._events else self._seq + 1
            if epoch != self.epoch or since_seq > self._seq or since_seq + 1 < oldest:
                return EventBatch(self.epoch, self._seq, True, sorted(self._held))
            if since_seq == self._seq:
                self._idle.add(reader)
                return None
            last: dict[bytes, bool] = {}  # each hash's last event: the net change
            for seq, kind, block_hash in reversed(self._events):
                if seq <= since_seq:
                    break
                last.setdefault(block_hash, kind)
            batch = EventBatch(self.epoch, self._seq, False)
            for block_hash, kind in last.items():
                (batch.stored if kind is STORED else batch.removed).append(block_hash)
            return batch

    def held(self) -> set[bytes]:
        with self._lock:
            return set(self._held)
