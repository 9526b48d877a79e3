"""What the engine reports: text and ``RequestOutput`` per request, and stage timings.

``OutputProcessor`` holds the engine's live requests and one ``Detokenizer`` each,
from admission until the output that reports the request finished. The scheduler
calls ``detokenize`` for every token it appends (stop strings are found there); the
engine calls ``build`` with the changes of a step. Engine thread only.

Invariant: a request is in ``requests`` exactly while it has not finished; its last
output says ``finished`` and carries the timings, as does its first token's. Logprobs
go out with the tokens they score; prompt logprobs with the first token. A decode
leg's first token is the prefill engine's, sampled there: it has no logprob here
(the prefill leg's stream carries it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.engine.request import Request, RequestStatus, TokenLogprob
from pdserve.runtime.detokenizer import Detokenizer

_FLUSHED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)  # held text goes out


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    timings: dict[str, float] | None = None  # with the first token and the final output
    logprobs: list[TokenLogprob] | None = None  # of new_token_ids, when asked for
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first token, when asked for


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, Detokenizer] = {}
        self._text: dict[str, str] = {}  # released by detokenize, not yet reported

    def add(self, request: Request) -> None:
        """Called by ``LLMEngine.add_request`` once the request is accepted."""
        self.requests[request.request_id] = request
        self._detok[request.request_id] = Detokenizer(self.tokenizer, request.sampling_params.stop)

    def pop(self, request_id: str) -> Request | None:
        """Forget a request the engine ends itself (abort, failure)."""
        self._detok.pop(request_id, None)
        self._text.pop(request_id, None)
        return self.requests.pop(request_id, None)

    def detokenize(self, request: Request, token: int) -> bool:
        """The scheduler appended ``token``: extend the text; True on a stop string."""
        rid = request.request_id
        text, hit_stop = self._detok[rid].append([token])
        self._text[rid] = self._text.get(rid, "") + text
        return hit_stop

    def build(self, changes: list[tuple[Request, list[int]]]) -> list[RequestOutput]:
        """One output per changed request; the finished ones are forgotten."""
        outputs = []
        for request, token_ids in changes:
            rid = request.request_id
            text = self._text.pop(rid, "")
            if request.status in _FLUSHED:
                text += self._detok[rid].flush()
            request.output_text += text
            outputs.append(self.output(request, token_ids, text))
            if request.is_finished and self.requests.get(rid) is request:
                self.pop(rid)
        return outputs

    def output(self, request: Request, token_ids: list[int], text: str = "",
               with_timings: bool = True) -> RequestOutput:
        """``request``'s output now; timings with its first token and once it finished."""
        timings = None
        is_first = bool(token_ids) and len(request.output_token_ids) == len(token_ids)
        if with_timings and (request.is_finished or len(request.output_token_ids) == 1):
            timings = request_timings(request, time.monotonic())
        logprobs = prompt_logprobs = None
        params = request.sampling_params
        if params.logprobs:
            logprobs, request.new_logprobs = request.new_logprobs, []
        if params.prompt_logprobs and is_first:
            prompt_logprobs = request.prompt_logprobs
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_text=text,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
            num_cached_tokens=request.num_cached_tokens,
            error=request.error,
            timings=timings,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


def request_timings(request: Request, now: float) -> dict[str, float]:
    """Stage durations of ``request`` so far, for the Coordinator's breakdown."""
    t: dict[str, float] = {}
    if request.kv_exposed_s is not None:  # decode leg
        arrived_s = max(request.kv_arrived_s or request.kv_exposed_s, request.arrival_s)
        t["kv_wait_s"] = arrived_s - request.arrival_s
        t["decode_queue_s"] = max(0.0, request.first_token_s - arrived_s)
    elif request.first_scheduled_s is not None:
        t["queue_s"] = request.first_scheduled_s - request.arrival_s
        if request.first_token_s is not None:
            t["prefill_s"] = request.first_token_s - request.first_scheduled_s
    if request.is_finished and request.first_token_s is not None:
        key = "kv_transfer_s" if request.pinned else "decode_s"  # pinned: the prefill leg
        t[key] = now - request.first_token_s
    return t
