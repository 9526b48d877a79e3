"""Continuous-batching scheduler (no torch).

Each step the scheduler hands the runner a batch: a list of ``(request, num_new_tokens)``
whose total stays within ``max_num_batched_tokens``. Prefill and decode are the same
thing seen from here: a request has ``num_tokens`` known tokens of which
``num_computed_tokens`` are in the KV cache; a step computes some of the rest. A long
prompt is therefore chunked across steps for free, and decode is the case of one new
token.

Policy, in order:
1. Running requests first (oldest first), so decodes keep their cadence.
2. When a running request needs a block and none is free, the most recently admitted
   running request is preempted by recompute: its blocks are freed and it goes back
   to the front of the waiting queue.
3. Then waiting requests, FIFO, while the token budget, the running cap
   (``max_num_seqs``) and the free blocks allow; no new admissions in a step that
   preempted (admitting would just thrash).
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
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not bm.allocate_slots(request, num_new):
                victim = self._pick_victim(i)
                if victim is None:  # only pinned requests left: wait for blocks
                    break
                self.running.remove(victim)
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is request:
                    break
            else:
                batch.items.append((request, num_new))
                budget -= num_new
                i += 1
                continue
            if request in self.running:
                i += 1

        while (
            self.waiting
            and budget > 0
            and not batch.num_preempted
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[0]
            cached = bm.find_cached_blocks(request) if request.num_computed_tokens == 0 else []
            num_uncached = request.num_tokens - len(cached) * bm.block_size
            num_new = min(num_uncached, budget)
            if not bm.allocate_slots(request, num_new, cached):
                break
            if request.num_preemptions == 0:
                bm.record_prefix_query(request.num_tokens, len(cached) * bm.block_size)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_s is None:
                request.first_scheduled_s = time.monotonic()
            self.running.append(request)
            batch.items.append((request, num_new))
            budget -= num_new
        return batch

    def _pick_victim(self, first: int) -> Request | None:
        """The most recently admitted running request at index >= ``first`` (not yet in
        this step's batch) that may be preempted."""
        for request in reversed(self.running[first:]):
            if not request.pinned:
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
