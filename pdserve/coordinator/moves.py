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

Balance, each round after the moves above: an engine that just joined a role (a
switch, a new replica) gets no stream until one ends, while the streams that started
before it stay where they are; on a decode engine whose step grows with the batch,
each of them runs slower than it would with half the batch. So per role, with this
Coordinator's own streams counted by the engine they stream from now (each
Coordinator balances its own, and the sum of balanced shares is balanced; no report
lag): when the most loaded engine runs at least ``BALANCE_MIN`` streams more than
the least loaded one that takes streams (routable, queues nothing, not refused or
failed a moment ago) and at least twice as many, half the difference moves, the
streams with the fewest tokens first (the cheapest to recompute, the most left to
run), as far as the target's free blocks above ``RESERVE`` go. One balance at a
time: the next waits until every stream it moved streams again (or ended).

Cost: nothing while no engine queues and no stream moves for balance; else O(runs)
per round.
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
BALANCE_MIN = 8  # a smaller difference of streams between two engines is left to the router
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
        self._transit: set[Movable] = set()  # moved for balance, not streaming again yet

    @property
    def enabled(self) -> bool:
        return self.stall_s > 0

    async def start(self) -> None:
        if self.enabled:
            await super().start()

    async def wait(self) -> None:
        await asyncio.sleep(min(self.stall_s / 2, MAX_INTERVAL_S))

    async def round(self) -> None:
        now = time.monotonic()
        self.move_stalled(now)
        self.balance(now)

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

    def balance(self, now: float) -> int:
        """Balance (``Algorithm`` above); returns the number of streams moved."""
        self._transit = {r for r in self._transit if r in self.runs and r.stream_engine() is None}
        if self._transit:
            return 0
        streams: dict[str, list[Movable]] = {}
        for run in self.runs:
            engine = run.stream_engine()
            if engine is not None and engine.role in ROLES:
                streams.setdefault(engine.instance_id, []).append(run)
        moved = 0
        for role in ROLES:
            engines = [e for e in self.registry.all() if e.role == role]
            takers = [e for e in engines if self._takes(e, now)]
            if len(engines) < 2 or not takers:
                continue
            busy = max(engines, key=lambda e: len(streams.get(e.instance_id, ())))
            target = min(takers, key=lambda e: len(streams.get(e.instance_id, ())))
            many, few = len(streams.get(busy.instance_id, ())), len(streams.get(target.instance_id, ()))
            if target is busy or many - few < max(BALANCE_MIN, many - many // 2):
                continue
            room = self._free_above_reserve(target)
            for run in sorted(streams[busy.instance_id], key=lambda r: r.num_tokens())[:(many - few) // 2]:
                blocks = run.num_tokens() // self.block_size + 1
                if blocks > room or not run.move():
                    continue
                room -= blocks
                self._transit.add(run)
                self.metrics.moves.inc()
                moved += 1
            if moved:
                self.registry.mark_full(busy.instance_id, self.stall_s)
                log.info("moved %d of %d streams off %s engine %s to balance (%s: %d)", moved, many, role,
                         busy.instance_id, target.instance_id, few)
        return moved

    def _takes(self, e: EngineEndpoint, now: float) -> bool:
        """Whether streams may move to ``e`` now."""
        return e.routable and not e.num_waiting and not e.is_full(now) and e.suspect_until <= now

    @staticmethod
    def _free_above_reserve(e: EngineEndpoint) -> int:
        total = e.num_kv_blocks_used + e.num_kv_blocks_free
        return max(0, e.num_kv_blocks_free - int(RESERVE * total))

    def _queues(self, engine: EngineEndpoint) -> bool:
        return engine.num_waiting > self._moved.get(engine.instance_id, 0)

    def _room(self, busy: EngineEndpoint, now: float) -> int:
        """Free blocks above the reserve of the engines a stream of ``busy`` may move to."""
        return sum(self._free_above_reserve(e) for e in self.registry.all()
                   if e is not busy and e.role == busy.role and self._takes(e, now))
