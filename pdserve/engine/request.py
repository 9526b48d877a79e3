"""Request state inside one engine.

A request moves through a small state machine; terminal states latch (``finish``
is a no-op once finished, so abort is idempotent):

    WAITING ──schedule──▶ RUNNING ──stop/length/abort──▶ FINISHED_*
       ▲                    │
       └────preempt─────────┘   (blocks freed, recomputed from scratch)

    WAITING_FOR_REMOTE_KV ──KV arrived──▶ RUNNING   (decode role: KV comes from a P)
    a leg whose KV found no room on D ──▶ FINISHED_FULL   (load, not an error)

``num_computed_tokens`` counts tokens whose KV is in the cache; everything else
(which blocks, which tokens are cached) is derived from it.

Log probabilities, for requests that ask (``SamplingParams.logprobs`` and
``prompt_logprobs``), are written by the runner, which has the logits:
``new_logprobs`` holds those of tokens not yet reported (the output processor takes
them), ``prompt_logprobs`` grows chunk by chunk during the prefill until it covers
every prompt token after the first.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, NamedTuple

from pdserve.api.sampling import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.guided import GuidedMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    # Prefill role: first token produced, the rest continues on a decode engine.
    FINISHED_HANDOFF = "handoff"
    # Either leg: D had no KV blocks for it ("decode full"); the engine is healthy, the
    # server answers RESOURCE_EXHAUSTED and the Coordinator waits or goes elsewhere.
    FINISHED_FULL = "full"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")


class TokenLogprob(NamedTuple):
    """One token's log probability and its likeliest alternatives, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_s: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_ids = () if sampling_params.ignore_eos else eos_token_ids
        self.status = RequestStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hash chain of this request's full blocks
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.num_preemptions = 0
        self.output_text = ""
        self.arrival_s = time.monotonic() if arrival_s is None else arrival_s
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.kv_arrived_s: float | None = None  # decode leg: P's DONE came off the wire
        self.kv_exposed_s: float | None = None  # decode leg: the engine loop exposed the KV
        self.error: str | None = None
        # Disaggregation: the transfer this request's KV belongs to (P or D side), and
        # whether it may be preempted (never while its blocks may be in flight).
        self.transfer_id: str | None = None
        self.pinned = False
        # The grammar matcher of a constrained request (``guided.py``), else None.
        self.guided: GuidedMatcher | None = None
        self.new_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] = []

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def generated_token_ids(self) -> list[int]:
        """Every token this request's stream generated: a continued stream's prompt ends
        with the ``sample_offset`` tokens earlier engines generated, then this engine's
        output. What presence and frequency penalties count (read by the runner on the
        step thread, for penalized requests only)."""
        num_prior = min(self.sampling_params.sample_offset, len(self.prompt_token_ids))
        prior = self.prompt_token_ids[len(self.prompt_token_ids) - num_prior:]
        return prior + self.output_token_ids if num_prior else self.output_token_ids

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs that the prefill has not computed yet: read by the
        runner (which positions need logits) and the block manager (no prefix cache:
        cached positions have no logits)."""
        return (self.sampling_params.prompt_logprobs
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    def finish(self, status: RequestStatus, error: str | None = None) -> bool:
        """Latch a terminal state. Returns False when already finished (idempotent)."""
        assert status.is_finished
        if self.is_finished:
            return False
        self.status = status
        self.error = error
        return True

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )
