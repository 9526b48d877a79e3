"""Moves: a stream stalled in a busy engine's queue goes on on an engine with room.

A decode engine whose cache is full preempts streams (by recompute) and queues new
local prefills; they wait there even when another decode engine has room: one the
planner just switched to decode, a replica just added, a pool whose load moved. The
Coordinator moves them: the stream's leg is cancelled and aborted, and the request
goes on as a continuation (``lifecycle``: the prompt plus the tokens already
streamed, the ``max_tokens`` left) on a plan that avoids the busy engine for a
moment (``InstanceRegistry.mark_full``); the client's stream does not break and no
retry is spent. Each move is counted (``pdserve_coordinator_moves_total``).

Algorithm, each round (every ``move_stalled_s / 2``, at most ``MAX_INTERVAL_S``):
- busy: a decode or hybrid engine whose last report says requests wait in its queue
  (``num_waiting > 0``);
- stalled: a run of this Coordinator whose stream is on a busy engine (a single leg,
  or a PD pair's decode leg once it streamed: before that, D is waiting for P's KV)
  and got nothing from it for ``move_stalled_s`` (since its last token, or since the
  attempt began);
- room: engines of the busy one's role that queue nothing, are routable and were not
  refused or failed a moment ago, with free blocks above ``RESERVE`` of their cache;
- moves, the longest stalled first: at most as many per busy engine as it reported
  waiting (moves already made count until the view changes: the report is that
  old), while the moved streams' blocks (their tokens so far) fit in the room.
A slow step stalls every stream of an engine, but only one that queues is busy,
and no more streams move than it queues.

Cost: nothing while no engine queues; else O(runs) per round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from .instances import EngineEndpoint, InstanceRegistry
from .metrics import CoordinatorMetrics
from .rounds import Rounds

log = logging.getLogger(__name__)
MAX_INTERVAL_S = 0.5
RESERVE = 0.1  # of a target's cache kept free of moved streams
ROLES = ("decode", "hybrid")  # whose streams move; prefill engines stream nothing


class Movable(Protocol):
    """What the Mover reads of a request (``lifecycle.RequestRun``)."""

    def stream_engine(self) -> EngineEndpoint | None:
        """The engine its stream's tokens come from now, when moving it is allowed."""

    def progress_s(self) -> float:
        """When its stream last moved on (monotonic): its last token, or its attempt's start."""

    def num_tokens(self) -> int:
        """Prompt and output tokens so far: what its KV holds."""

    def move(self) -> bool:
        """Cut its stream so the request goes on elsewhere; False when it cannot now."""


class Mover(Rounds):
    task_name = "stream moves"

    def __init__(self, registry: InstanceRegistry, metrics: CoordinatorMetrics,
                 stall_s: float, block_size: int) -> None:
        self.registry = registry
        self.metrics = metrics
        self.stall_s = stall_s
        self.block_size = block_size
        self.runs: set[Movable] = set()  # the requests streaming now, kept by ``lifecycle``
        self._version = -1  # the view the counts below are of
        self._moved: dict[str, int] = {}  # busy engine id -> streams moved off it
        self._taken = 0  # blocks of the room moved streams took

    @property
    def enabled(self) -> bool:
        return self.stall_s > 0

    async def start(self) -> None:
        if self.enabled:
            await super().start()

    async def wait(self) -> None:
        await asyncio.sleep(min(self.stall_s / 2, MAX_INTERVAL_S))

    async def round(self) -> None:
        self.move_stalled(time.monotonic())

    def move_stalled(self, now: float) -> int:
        """One round (``Algorithm`` above); returns the number of streams moved."""
        if self.registry.version != self._version:
            self._version, self._moved, self._taken = self.registry.version, {}, 0
        stalled: dict[str, list[Movable]] = {}
        for run in self.runs:
            engine = run.stream_engine()
            if engine is None or engine.role not in ROLES or not self._queues(engine):
                continue
            if now - run.progress_s() >= self.stall_s:
                stalled.setdefault(engine.instance_id, []).append(run)
        moved = 0
        for engine_id, runs in stalled.items():
            busy = self.registry.get(engine_id)
            if busy is None:
                continue
            room = self._room(busy, now) - self._taken
            runs.sort(key=lambda r: r.progress_s())
            moved_here = 0
            for run in runs[:busy.num_waiting - self._moved.get(engine_id, 0)]:
                blocks = run.num_tokens() // self.block_size + 1
                if blocks > room or not run.move():
                    continue
                room -= blocks
                self._taken += blocks
                self._moved[engine_id] = self._moved.get(engine_id, 0) + 1
                self.metrics.moves.inc()
                moved_here += 1
            if moved_here:
                self.registry.mark_full(engine_id, self.stall_s)
            moved += moved_here
        if moved:
            log.info("moved %d stalled stream(s) off busy engine(s) %s", moved,
                     ", ".join(sorted(self._moved)))
        return moved

    def _queues(self, engine: EngineEndpoint) -> bool:
        return engine.num_waiting > self._moved.get(engine.instance_id, 0)

    def _room(self, busy: EngineEndpoint, now: float) -> int:
        """Free blocks above the reserve of the engines a stream of ``busy`` may move to."""
        room = 0
        for e in self.registry.all():
            if (e is busy or e.role != busy.role or not e.routable or e.num_waiting
                    or e.is_full(now) or e.suspect_until > now):
                continue
            total = e.num_kv_blocks_used + e.num_kv_blocks_free
            room += max(0, e.num_kv_blocks_free - int(RESERVE * total))
        return room
