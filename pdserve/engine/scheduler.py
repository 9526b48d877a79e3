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
   (admitting would just thrash), and none after the first one did not fit.
   Preempted requests come first (their streams have stalled), then the shortest. What
   the waiting requests need, blocks and running slots, is owed to them
   (``BlockManager.owed_blocks``, ``free_seats``): a KV transfer's reservation leaves
   it, so on a full decode engine new streams wait for a preempted one (or a local
   prefill queued before them) instead of starving it, and no more streams run than
   ``max_num_seqs``.

Thresholds: ``prefill_chunk_tokens`` (engine setting, 512 by default) and
``max_num_batched_tokens`` (2048). Cost: one sort of the prefilling requests per step.

After the step, ``postprocess`` does the token bookkeeping (computed tokens, prefix
cache, counters) and decides stop or length; ``apply_kv_events`` applies what the KV
connector raised. The scheduler is the one owner of a request's blocks: it frees
them on preemption and when a request ends, unless the connector says (once, from
``request_finished``) that a write may still land; those come back as a
``released`` event, freed here too.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.load_counters import LoadCounters
from pdserve.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdserve.engine.kv_transfer.base import ConnectorEvents, KVConnector

# The output processor's detokenizer: takes the newest token, True on a stop string.
Detokenize = Callable[[Request, int], bool]
# A request whose output changed this step, with the tokens it gained.
Change = tuple[Request, list[int]]


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
        max_request_tokens: int | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        """``max_request_tokens``: most tokens one request may hold (model length and the
        whole KV cache); ``connector``: the engine's KV connector, if it has one."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens or max_num_batched_tokens
        self.max_request_tokens = max_request_tokens or block_manager.num_blocks * block_manager.block_size
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prompt_tokens_total = 0  # prefilled, recomputation after preemption excluded
        self.num_generation_tokens_total = 0
        self.counters = LoadCounters()
        self._owe()

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        bm = self.block_manager
        bm.owed_blocks += bm.num_blocks_for(request.num_tokens)
        bm.free_seats -= 1

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
        waiting = iter(sorted(self.waiting, key=_admission_order))
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
        self._owe()
        return batch

    def _owe(self) -> None:
        """What the waiting requests are owed (policy 4.); after every change of the
        queues a KV transfer's reservation may see: a step's schedule, its KV events (a
        step that exposes a request schedules nothing), an arrival."""
        bm = self.block_manager
        bm.owed_blocks = sum(bm.num_blocks_for(r.num_tokens) for r in self.waiting)
        bm.free_seats = self.max_num_seqs - len(self.running) - len(self.waiting)

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

    def _preempt(self, request: Request) -> None:
        self._free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- after the step ----------------------------------------------------------------

    def postprocess(self, batch: ScheduledBatch, sampled: dict[str, int],
                    detokenize: Detokenize) -> list[Change]:
        """Called by the engine after the runner executed ``batch``: advance every request's
        computed tokens, publish full blocks, append each sampled token and end the
        requests that stopped or reached their length. Returns who gained a token."""
        now = time.monotonic()
        changes = []
        for request, num_new in batch.items:
            request.num_computed_tokens += num_new
            if request.num_preemptions == 0 and request.num_computed_tokens <= request.num_prompt_tokens:
                self.num_prompt_tokens_total += num_new
            self.block_manager.cache_full_blocks(request)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            if request.first_token_s is None:  # prefilled here
                request.first_token_s = now
                self.counters.prefilled(request)
            changes.append(self._append_token(request, token, detokenize))
        return changes

    def apply_kv_events(self, events: ConnectorEvents, detokenize: Detokenize) -> list[Change]:
        """Called by the engine at the start of a step with what the connector raised; a
        request that ended meanwhile is skipped (its blocks went when it ended)."""
        changes = []
        for request in events.ready:  # P: destination reserved, prefill may start
            if not request.is_finished:
                self.add(request)
        for request, token, seed in events.exposed:  # D: every layer arrived
            if not request.is_finished:
                changes.append(self._expose(request, token, seed, detokenize))
        for request in events.handed_off:
            if self.finish(request, RequestStatus.FINISHED_HANDOFF):
                changes.append((request, []))
        # "full": D had no room for the KV, which is load, not an error.
        for status, ended in ((RequestStatus.FINISHED_ERROR, events.failed),
                              (RequestStatus.FINISHED_FULL, events.full)):
            for request, reason in ended:
                if self.finish(request, status, reason):
                    changes.append((request, []))
        for request in events.released:  # kept at the end; no write can land any more
            self._free(request)
        if events.exposed:  # running grew, and this step may schedule nothing
            self._owe()
        return changes

    def _expose(self, request: Request, token: int, seed: int | None,
                detokenize: Detokenize) -> Change:
        """D: the prompt's KV is in the blocks; run the request with P's first token."""
        if seed is not None:  # continue P's random stream
            request.sampling_params = dataclasses.replace(request.sampling_params, seed=seed)
        request.num_computed_tokens = request.num_prompt_tokens
        self.block_manager.cache_full_blocks(request)
        self.add_running(request)
        request.first_token_s = request.kv_exposed_s = time.monotonic()
        return self._append_token(request, token, detokenize)

    def _append_token(self, request: Request, token: int, detokenize: Detokenize) -> Change:
        request.output_token_ids.append(token)
        self.num_generation_tokens_total += 1
        hit_stop = detokenize(request, token)
        guided = request.guided
        if guided is not None:
            guided.advance(token)
        if request.pinned:  # prefill leg: hand the KV off instead of decoding on
            if request in self.running:
                self.running.remove(request)
            self.connector.prefill_done(request, token)
            return request, [token]
        params = request.sampling_params
        if guided is not None and guided.error is not None:
            self.finish(request, RequestStatus.FINISHED_ERROR, guided.error)
        elif (hit_stop or token in params.stop_token_ids or token in request.eos_token_ids
              or (guided is not None and guided.is_done)):  # the grammar is complete
            self.finish(request, RequestStatus.FINISHED_STOPPED)
        elif (len(request.output_token_ids) >= params.max_tokens
              or request.num_tokens >= self.max_request_tokens):
            self.finish(request, RequestStatus.FINISHED_LENGTH)
        return request, [token]

    # -- the end -------------------------------------------------------------------------

    def finish(self, request: Request, status: RequestStatus, error: str | None = None) -> bool:
        """End ``request`` wherever it is and free its blocks, unless the KV connector keeps
        them until no write can land (``request_finished``). Idempotent."""
        if not request.finish(status, error):
            return False
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.counters.finished(self.final_tokens(request) - request.num_prompt_tokens)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.connector is None or not self.connector.request_finished(request):
            self._free(request)
        return True

    def final_tokens(self, request: Request) -> int:
        """The tokens ``request`` holds at its longest: its prompt and all the output its
        ``max_tokens`` allows, within what one request may hold."""
        return min(request.num_prompt_tokens + request.sampling_params.max_tokens, self.max_request_tokens)

    def _free(self, request: Request) -> None:
        """The only place blocks go back to the pool."""
        self.block_manager.free(request)


def _remaining(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


def _admission_order(request: Request) -> tuple[bool, int]:
    """Preempted requests first, then the shortest remaining."""
    return request.status != RequestStatus.PREEMPTED, _remaining(request)
