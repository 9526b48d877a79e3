"""Continuous-batching scheduler (no torch).

Each step the scheduler hands the runner a batch: a list of ``(request, num_new_tokens)``
whose total stays within ``max_num_batched_tokens``. Prefill and decode are the same
thing seen from here: a request has ``num_tokens`` known tokens of which
``num_computed_tokens`` are in the KV cache; a step computes some of the rest. A long
prompt is therefore chunked across steps, and decode is the case of one new token.

Policy, in order:
1. Decodes first (running requests with one token to compute, oldest first), so
   streams keep their cadence whatever prefills are queued.
2. Then prefill work, shortest remaining first: running requests still prefilling and
   waiting requests, ordered by prompt tokens left to compute (ties: running before
   waiting, then arrival order), at most ``prefill_chunk_tokens`` prompt tokens per
   step in all. So no step runs longer than about one chunk plus the decodes: a short
   prompt that arrives during a long prefill waits about one chunk, not the whole
   prompt, and (on a hybrid engine) a decode stalls at most one chunk; the long
   prompt advances with whatever the shorter ones leave of the chunk.
3. When a running request needs a block and none is free, the most recently admitted
   running request is preempted by recompute: its blocks are freed and it goes back
   to the front of the waiting queue.
4. Waiting requests are admitted while the token budget, the running cap
   (``max_num_seqs``) and the free blocks allow; none in a step that preempted
   (admitting would just thrash), and none after the shortest one did not fit.

Thresholds: ``prefill_chunk_tokens`` (engine setting, 512 by default) and
``max_num_batched_tokens`` (2048). Cost: one sort of the prefilling requests per step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    items: list[tuple[Request, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_chunk_tokens: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens or max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> ScheduledBatch:
        """Called by the engine once per step: the batch to run (policy at the top)."""
        batch = ScheduledBatch()
        self._budget = self.max_num_batched_tokens
        decodes = [r for r in self.running if _remaining(r) == 1]
        for request in decodes:
            if self._budget <= 0:
                break
            if request in self.running:  # not preempted by an earlier one
                self._schedule_running(request, batch)
        self._budget = min(self._budget, self.prefill_chunk_tokens)  # prefill tokens this step
        prefills = sorted((r for r in self.running if _remaining(r) > 1), key=_remaining)
        can_admit = True
        waiting = iter(sorted(self.waiting, key=_remaining))
        candidate = next(waiting, None)
        while self._budget > 0 and (prefills or (candidate is not None and can_admit)):
            admit_next = candidate is not None and can_admit and (
                not prefills or _remaining(candidate) < _remaining(prefills[0]))
            if admit_next:
                can_admit = self._admit(candidate, batch)
                candidate = next(waiting, None)
                continue
            request = prefills.pop(0)
            if request in self.running:
                self._schedule_running(request, batch)
        return batch

    def _schedule_running(self, request: Request, batch: ScheduledBatch) -> None:
        num_new = min(_remaining(request), self._budget)
        bm = self.block_manager
        while not bm.allocate_slots(request, num_new):
            scheduled = {id(r) for r, _ in batch.items}
            victim = self._pick_victim(scheduled)
            if victim is None:  # only pinned or scheduled requests left: wait for blocks
                return
            self.running.remove(victim)
            self._preempt(victim)
            batch.num_preempted += 1
            if victim is request:
                return
        batch.items.append((request, num_new))
        self._budget -= num_new

    def _admit(self, request: Request, batch: ScheduledBatch) -> bool:
        """Try to start a waiting request; False stops admissions for this step."""
        if batch.num_preempted or len(self.running) >= self.max_num_seqs:
            return False
        bm = self.block_manager
        cached = bm.find_cached_blocks(request) if request.num_computed_tokens == 0 else []
        num_uncached = request.num_tokens - len(cached) * bm.block_size
        num_new = min(num_uncached, self._budget)
        if not bm.allocate_slots(request, num_new, cached):
            return False
        if request.num_preemptions == 0:
            bm.record_prefix_query(request.num_tokens, len(cached) * bm.block_size)
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_s is None:
            request.first_scheduled_s = time.monotonic()
        self.running.append(request)
        batch.items.append((request, num_new))
        self._budget -= num_new
        return True

    def _pick_victim(self, scheduled: set[int]) -> Request | None:
        """The most recently admitted running request not yet in this step's batch that
        may be preempted (never a pinned one: its blocks may be in flight)."""
        for request in reversed(self.running):
            if not request.pinned and id(request) not in scheduled:
                return request
        return None

    def add_running(self, request: Request) -> None:
        """Admit a request whose KV is already in its blocks (decode role, KV received)."""
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_s is None:
            request.first_scheduled_s = time.monotonic()
        self.running.append(request)

    def detach(self, request: Request) -> None:
        """Take a request out of scheduling, keeping its blocks (prefill role, handing off)."""
        if request in self.running:
            self.running.remove(request)

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(
        self, request: Request, status: RequestStatus, error: str | None = None,
        free_blocks: bool = True,
    ) -> bool:
        """End ``request`` wherever it is and free its blocks (unless the KV connector
        owns them: ``free_blocks=False``). Idempotent."""
        if not request.finish(status, error):
            return False
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if free_blocks:
            self.block_manager.free(request)
        return True


def _remaining(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens
