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
switch, a new replica) gets no stream until one ends, while those that started before
stay where they are; on a decode engine whose step grows with the batch, each of them
runs slower than it would with half the batch, and its cache fills. So per role, with
the legs this Coordinator has in flight on each engine (``num_inflight``: streaming,
and planned: a PD leg waiting for its KV at P counts on its D, so a wave still at P is
not taken for room), when the most loaded engine has at least ``BALANCE_MIN`` legs
more than the least loaded one that takes streams (routable, queues nothing, not
refused or failed a moment ago) and at least twice as many, half the difference of
its streams moves to that one, the streams with the fewest tokens first (the
cheapest to recompute, the most left to run), as far as the target's free blocks
above ``RESERVE`` go; only streams with at least as many tokens left to generate as
they hold (a stream near its end, as a phase's streams end together, is not worth
its recompute). A stream moved for balance goes on on the target alone (it
prefills its prompt and tokens so far there: no prefill engine's queue, which the
planner would read as prompt demand), and neither rule moves it again, nor does the
next balance start, until it has a new token.

Cost: nothing while no engine queues and the legs are balanced; else O(runs) per round.
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
BALANCE_MIN = 8  # a smaller difference of legs between two engines is left to the router
ROLES = ("decode", "hybrid")  # whose streams move; prefill engines stream nothing


class Movable(Protocol):
    """What the Mover reads of a request (``lifecycle.RequestRun``)."""

    def stream_engine(self) -> EngineEndpoint | None:
        """The engine its stream's tokens come from now, when moving it is allowed."""

    def progress_s(self) -> float:
        """When its stream last moved on (monotonic): its last token, or its attempt's start."""

    def num_tokens(self) -> int:
        """Prompt and output tokens so far: what its KV holds."""

    def tokens_left(self) -> int:
        """Output tokens it may still generate (``max_tokens`` less those streamed)."""

    def move(self, to: EngineEndpoint | None = None) -> bool:
        """Cut its stream so the request goes on elsewhere (on ``to`` alone when given);
        False when it cannot now."""


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
        self._settling: dict[Movable, int] = {}  # moved for balance -> its tokens then

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
        self._prune_settled()
        for run in self.runs:
            engine = run.stream_engine()
            if (engine is None or engine.role not in ROLES or not self._queues(engine)
                    or run in self._settling):
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
        self._prune_settled()
        if self._settling:
            return 0
        moved = 0
        for role in ROLES:
            engines = [e for e in self.registry.all() if e.role == role and e.routable]
            takers = [e for e in engines if self._takes(e, now)]
            if len(engines) < 2 or not takers:
                continue
            busy = max(engines, key=lambda e: e.num_inflight)
            target = min(takers, key=lambda e: e.num_inflight)
            many, few = busy.num_inflight, target.num_inflight
            if target is busy or many - few < max(BALANCE_MIN, many - many // 2):
                continue
            streams = sorted((r for r in self.runs if r.stream_engine() is busy
                              and r.tokens_left() >= r.num_tokens()), key=lambda r: r.num_tokens())
            room = self._free_above_reserve(target) - self._taken
            moved_here = 0
            for run in streams[:(many - few) // 2]:
                tokens = run.num_tokens()
                blocks = tokens // self.block_size + 1
                if blocks > room or not run.move(target):
                    continue
                room -= blocks
                self._settling[run] = tokens
                self.metrics.moves.inc()
                moved_here += 1
            if moved_here:
                log.info("moved %d stream(s) off %s engine %s (%d legs) to %s (%d legs) to balance",
                         moved_here, role, busy.instance_id, many, target.instance_id, few)
            moved += moved_here
        return moved

    def _prune_settled(self) -> None:
        """Forget the streams balance moved that have a new token since, or ended."""
        self._settling = {r: n for r, n in self._settling.items() if r in self.runs and r.num_tokens() == n}

    def _queues(self, engine: EngineEndpoint) -> bool:
        return engine.num_waiting > self._moved.get(engine.instance_id, 0)

    def _takes(self, e: EngineEndpoint, now: float) -> bool:
        """Whether streams may move to ``e`` now."""
        return e.routable and not e.num_waiting and not e.is_full(now) and e.suspect_until <= now

    @staticmethod
    def _free_above_reserve(e: EngineEndpoint) -> int:
        total = e.num_kv_blocks_used + e.num_kv_blocks_free
        return max(0, e.num_kv_blocks_free - int(RESERVE * total))

    def _room(self, busy: EngineEndpoint, now: float) -> int:
        """Free blocks above the reserve of the engines a stream of ``busy`` may move to."""
        return sum(self._free_above_reserve(e) for e in self.registry.all()
                   if e is not busy and e.role == busy.role and self._takes(e, now))
