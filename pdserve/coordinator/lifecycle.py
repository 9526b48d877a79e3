"""A request's life from routing to its last token: attempts, retries, continuation.

``RequestRun.tokens()`` yields the output token ids as the engines produce them.
Each attempt asks the router for a plan and runs its legs (``legs.py``): a PD pair
(``PairedLegs``: the decode leg is sent first, then the prefill leg with the same
transfer id) or one engine (``Leg``).

Identity: ``request_id`` is the Coordinator's own (``cmpl-`` and 32 hex digits,
never the client's); leg ids are it plus ``.N`` from the second attempt on, and
transfer ids ``x-`` plus the leg id, all far below the engines' 128 characters and
unique per attempt, so two requests never share an id on an engine whatever their
clients send. A client's ``x-request-id`` is only the ``label``: logs, timings.

Failures (``LegFailure``): P fails before handoff, or D before its first token:
the attempt is retried on other engines. D fails mid-stream: the request goes on
on a new plan whose prompt is the original prompt plus every token already
streamed and whose ``max_tokens`` is what is left, so the client's stream
continues without a visible break. At most ``max_retries`` retries with bounded
exponential backoff; everything (routing waits, calls, backoff) lives inside the
deadline of the request's next token (``deadlines.py``): the first-token deadline
until the stream began, then the idle gap from the last token received, so a
continuation must bring its next token within it; the client's or the settings'
total, when set, caps both. Each failure is logged, at most once per engine, leg and
reason per ``LOG_INTERVAL_S`` (``ThrottledLog``).

Load (``EngineFull``): an engine with no room is healthy. It is not marked failed
and uses no retry; the registry avoids it for ``FULL_AVOID_S`` so the next plan
takes an engine with room if there is one. When every candidate of the plan said
"full", the request waits with the same backoff before trying again, within its
deadline and for at most ``overload_max_wait_s`` after the first "full"; then 503
``overloaded`` with ``Retry-After`` (``pdserve_coordinator_overload_total{leg}``
counts the answers).

``SamplingParams`` (``api/sampling.py``, the carrier the engine reads too) is what the
client asked for, fixed at arrival; ``engine_request`` is the one place it becomes the
engine's ``GenerateRequest``, for the first attempt and for a continuation alike
(``paired_requests``: a PD attempt's two, built the same way).

Logprobs: every leg that samples reports its tokens' (``logprobs``); prompt logprobs
are asked of the leg that prefills, on an attempt that has streamed nothing yet (a
continuation's prompt holds generated tokens, and the client has the prompt's
already). ``RequestRun.logprobs`` stays in step with ``generated``.

Timings: a PD attempt whose decode leg finished before its prefill leg's stream ended
waits for that stream (``PairedLegs.wait_report``) before the run ends, so the
answer's timings, cached tokens and stage metrics hold P's report.

Invariants: an attempt's legs are closed before the next attempt starts and when
the run is closed (stop string, client gone: closing the generator runs the
``finally``), which cancels and aborts the legs that did not finish.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.api.proto import engine_pb2 as pb
from pdserve.api.sampling import SamplingParams
from pdserve.runtime.log_throttle import ThrottledLog

from .deadlines import Deadlines
from .errors import ServeError
from .instances import EngineEndpoint, InstanceRegistry
from .legs import Aborter, DecodeLeg, EngineFull, Leg, LegFailure, PairedLegs, PrefillLeg
from .metrics import CoordinatorMetrics
from .moves import Mover
from .policies import RouteContext
from .router import Plan, Router
from .settings import CoordinatorSettings
from .timings import RequestTimings

log = logging.getLogger(__name__)
FULL_AVOID_S = 0.25  # an engine that answered "full" is tried last for this long
LOG_INTERVAL_S = 10.0  # one line per engine, leg and reason per interval


_IDS = random.Random()  # its own, seeded from the OS at start: no one's seed() touches it


def new_request_id() -> str:
    """The Coordinator's id of a new request; its engines see it (``RequestRun``). 128
    random bits, written as uuid4's hex is, from a generator seeded from the OS once
    (``os.urandom`` is a system call per id, ``uuid.UUID`` five times the cost)."""
    return f"cmpl-{_IDS.getrandbits(128):032x}"


@dataclass
class Deps:
    """What every request needs; built once by ``create_app``."""

    settings: CoordinatorSettings
    registry: InstanceRegistry
    router: Router
    metrics: CoordinatorMetrics
    aborter: Aborter
    mover: Mover | None = None  # None: streams are never moved
    engine_log: ThrottledLog = field(default_factory=lambda: ThrottledLog(log, LOG_INTERVAL_S))


def engine_request(params: SamplingParams, leg_id: str, prompt_ids: list[int], num_generated: int,
                   kv_transfer: pb.KVTransferParams | None = None) -> pb.GenerateRequest:
    """One leg's request. ``prompt_ids`` is the original prompt followed by the
    ``num_generated`` tokens already streamed: the leg asks for what is left and
    samples from where the stream stands (a seeded stream draws the same numbers,
    and ``sample_offset`` tells the engine the prompt's last ``num_generated`` tokens
    are output, which the presence and frequency penalties count). Only a leg that
    prefills the client's own prompt scores it (``prompt_logprobs``)."""
    sampling = params.to_proto()
    sampling.max_tokens = params.max_tokens - num_generated
    sampling.min_tokens = max(0, params.min_tokens - num_generated)
    sampling.sample_offset = num_generated
    prefills = kv_transfer is None or kv_transfer.role == "prefill"
    sampling.prompt_logprobs = params.prompt_logprobs and prefills and num_generated == 0
    return pb.GenerateRequest(request_id=leg_id, prompt_token_ids=prompt_ids,
                              kv_transfer=kv_transfer, sampling=sampling)


def paired_requests(params: SamplingParams, leg_id: str, prompt_ids: list[int],
                    num_generated: int, decode_kv: pb.KVTransferParams,
                    prefill_kv: pb.KVTransferParams) -> tuple[pb.GenerateRequest, pb.GenerateRequest]:
    """A PD attempt's (decode, prefill) requests, each ``engine_request``'s. The prefill
    request is made from the decode request's fields: copying a repeated field or a
    message costs a fraction of setting it from Python values."""
    decode = engine_request(params, leg_id, prompt_ids, num_generated, decode_kv)
    prefill = pb.GenerateRequest(request_id=leg_id, kv_transfer=prefill_kv, sampling=decode.sampling)
    prefill.prompt_token_ids.MergeFrom(decode.prompt_token_ids)
    prefill.sampling.prompt_logprobs = params.prompt_logprobs and num_generated == 0
    return decode, prefill


class RequestRun:
    """One request's attempts; built by serving, iterated through ``tokens`` on the event loop.
    ``label`` is what the client calls it (its ``x-request-id``), ``request_id`` by default."""

    def __init__(self, deps: Deps, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 deadlines: Deadlines, arrival_s: float | None = None, label: str | None = None) -> None:
        self.deps = deps
        self.arrival_s = time.monotonic() if arrival_s is None else arrival_s
        self.request_id = request_id
        self.label = label or request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.deadlines = deadlines
        self._last_s: float | None = None  # when the last token streamed reached the Coordinator
        self.generated: list[int] = []
        self.logprobs: list[pb.TokenLogprob] = []  # one per generated token, when asked for
        self.prompt_logprobs: list[pb.TokenLogprob] | None = None  # when asked for
        self.finish_reason: str | None = None
        self.timings = RequestTimings(self.label, deps.metrics)
        self.num_attempts = 0
        self.plan: Plan | None = None  # the last attempt's
        self.prefer: Plan | None = None  # a sibling choice's plan, for the first attempt
        self._move_to: Plan | None = None  # ``move``'s target, for the next attempt
        self._num_full_waits = 0
        self._full_since: float | None = None  # when an engine first said "full"
        self.collects = False  # set by an output read whole: legs hand on their tokens at the end
        self._legs: Leg | PairedLegs | None = None  # the attempt's
        self._attempt_s = 0.0  # when the attempt began
        self._moving: EngineEndpoint | None = None  # the engine its stream is being moved off

    @property
    def last_tokens_s(self) -> float:
        """When the ids ``tokens`` last gave reached the Coordinator (a collecting run's).
        A leg started before the run was set to collect (a sibling choice of ``n``, whose
        first message was read as a stream's) stamps no arrivals: its messages are handed
        on as they come, so reading the clock now is their arrival."""
        return self._legs.arrival_s or time.monotonic()

    @property
    def deadline(self) -> float:
        """When the request's next token is due (``Deadlines.next_token_s``): what the
        next attempt, its routing wait and a retry's backoff must fit in."""
        return self.deadlines.next_token_s(self._last_s)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    async def tokens(self) -> AsyncIterator[list[int]]:
        """Called by serving; iterate to the end or close it (stop string, client gone)."""
        mover = self.deps.mover
        if mover is not None:
            mover.runs.add(self)
        try:
            s = self.deps.settings
            exclude: set[str] = set()
            failures = 0
            last_full: EngineFull | None = None
            while True:
                if len(self.generated) >= self.params.max_tokens:
                    self.finish_reason = "length"
                    return
                prompt = self.prompt_ids + self.generated
                prefer, self._move_to = self.prefer if self.num_attempts == 0 else self._move_to, None
                plan = self.plan = await self.deps.router.plan(
                    RouteContext(prompt, s.block_size), exclude, self.deadline, prefer)
                if last_full is not None and _is_full(plan):
                    await self._wait_for_room(last_full)
                self.num_attempts += 1
                self.timings.report["attempts"] = self.num_attempts
                if self.num_attempts == 1:  # arrival -> first leg sent: tokenize, admit, route
                    self.timings.observe("route", time.monotonic() - self.arrival_s)
                legs = self._legs = self._new_legs(plan, prompt)
                self._attempt_s, self._moving = time.monotonic(), None
                try:
                    try:
                        left = self.left_s()
                        if left <= 0:
                            raise self.deadlines.passed(self._last_s)
                        legs.start(left, self.collects)
                        async for ids in legs.tokens():
                            self.generated.extend(ids)
                            if self.params.logprobs:
                                self.logprobs += legs.take_logprobs()
                            if self.params.prompt_logprobs and self.prompt_logprobs is None:
                                self.prompt_logprobs = self._checked_prompt_logprobs(legs)
                            yield ids
                        if legs.has_pending_report:
                            await legs.wait_report()
                    finally:
                        legs.close()
                        if legs.has_token:  # the idle gap of what comes next runs from here
                            self._last_s = legs.last_arrival_s
                    self.finish_reason = legs.finish_reason
                    return
                except ServeError as err:
                    if err.code == "deadline":  # which one: the leg's call cannot say
                        raise self.deadlines.passed(self._last_s) from None
                    raise
                except EngineFull as full:
                    last_full = full
                    self._on_full(full)
                except LegFailure as f:
                    if f.engine is self._moving:  # ``move``: not a failure
                        self._moving = None
                        continue
                    failures += 1
                    self.deps.metrics.retries.labels(f.leg, f.stage).inc()
                    if f.stage == "mid_stream":
                        self.deps.metrics.continuations.inc()
                    self.deps.registry.mark_failed(f.engine.instance_id)
                    exclude.add(f.engine.instance_id)
                    self.deps.engine_log.log(logging.WARNING, (f.engine.address, f.leg, f.reason),
                                             "leg failed (%s): %s", f.stage, f)
                    if failures > s.max_retries:
                        raise ServeError(502, f"gave up after {failures} failed attempts; last: {f.public}",
                                         code="engine_failure") from None
                    backoff = min(s.retry_backoff_s * 2 ** (failures - 1), s.retry_backoff_max_s)
                    if backoff >= self.left_s():
                        passed = self.deadlines.passed(self._last_s)
                        raise ServeError(504, f"{passed.message} while retrying after: {f.public}",
                                         code="deadline") from None
                    await asyncio.sleep(backoff)
        finally:
            if mover is not None:
                mover.runs.discard(self)

    # -- read and called by the Mover (``moves.py``) --

    def stream_engine(self) -> EngineEndpoint | None:
        """The engine the stream's tokens come from, while its leg may be cut to move it:
        a single leg, or a PD pair's decode leg once it streamed."""
        legs = self._legs
        if legs is None or self._moving is not None:
            return None
        return legs.stream_engine()

    def progress_s(self) -> float:
        legs = self._legs
        return legs.last_arrival_s if legs is not None and legs.has_token else self._attempt_s

    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    def tokens_left(self) -> int:
        return self.params.max_tokens - len(self.generated)

    def move(self, to: EngineEndpoint | None = None) -> bool:
        """Cuts the stream's leg: the attempt ends as a failure of its engine's, which
        ``_attempts`` takes for a move and goes on with a new plan (a continuation): on
        ``to`` alone when given and still routable (it prefills the prompt and the tokens
        so far itself), else as the router plans it."""
        legs = self._legs
        engine = None if legs is None or self._moving is not None else legs.interrupt()
        self._moving = engine
        self._move_to = Plan("single", single=to) if engine is not None and to is not None else None
        return engine is not None

    def _checked_prompt_logprobs(self, legs: Leg | PairedLegs) -> list[pb.TokenLogprob]:
        """The prompt's logprobs from the engine that prefilled: one per prompt token
        after the first, or a 502 (an engine that does not compute them)."""
        scored = legs.prompt_logprobs or []
        if len(scored) != len(self.prompt_ids) - 1:
            raise ServeError(502, f"the prefill engine sent {len(scored)} prompt logprobs for "
                             f"{len(self.prompt_ids)} prompt tokens", code="engine_failure")
        return scored

    def _on_full(self, full: EngineFull) -> None:
        """An engine had no room: counted, logged, marked full (not failed); 503 once
        the request has waited ``overload_max_wait_s`` since the first such answer."""
        self.deps.metrics.overloads.labels(full.leg).inc()
        self.deps.registry.mark_full(full.engine.instance_id, FULL_AVOID_S)
        self.deps.engine_log.log(logging.INFO, (full.engine.address, full.leg, "full"),
                                 "%s engine %s has no room: %s", full.leg, full.engine.address,
                                 full.details)
        now = time.monotonic()
        if self._full_since is None:
            self._full_since = now
        if now - self._full_since >= self.deps.settings.overload_max_wait_s:
            raise self._overloaded(full)

    async def _wait_for_room(self, last: EngineFull) -> None:
        """Every engine of the next plan said "full" a moment ago: back off (with
        jitter, so waiting requests do not come back at once), or give up with 503
        when the wait would pass the overload bound or the deadline."""
        s = self.deps.settings
        self._num_full_waits += 1
        backoff = min(s.retry_backoff_s * 2 ** (self._num_full_waits - 1), s.retry_backoff_max_s)
        backoff *= random.uniform(0.5, 1.0)
        waited = time.monotonic() - self._full_since
        if waited + backoff > s.overload_max_wait_s or backoff >= self.left_s():
            raise self._overloaded(last)
        await asyncio.sleep(backoff)

    def _overloaded(self, last: EngineFull) -> ServeError:
        waited = time.monotonic() - self._full_since
        retry_after = max(1, math.ceil(self.deps.settings.retry_backoff_max_s))
        return ServeError(503, f"overloaded: no engine had room for the request within "
                          f"{waited:.1f}s; last: {last.public}", code="overloaded",
                          headers={"Retry-After": str(retry_after)})

    def _new_legs(self, plan: Plan, prompt: list[int]) -> Leg | PairedLegs:
        # Engines refuse a reused id; attempts after the first get a suffix.
        n = self.num_attempts
        leg_id = self.request_id if n == 1 else f"{self.request_id}.{n}"
        num_generated = len(self.generated)
        report = self.timings.report
        if plan.kind != "pd":
            report["prefill_instance"] = report["decode_instance"] = plan.single.address
            return self._leg(Leg, plan.single, engine_request(self.params, leg_id, prompt, num_generated))
        p, d = plan.prefill, plan.decode
        report["prefill_instance"], report["decode_instance"] = p.address, d.address
        mode, xid = self.deps.settings.kv_mode, f"x-{leg_id}"
        decode_request, prefill_request = paired_requests(
            self.params, leg_id, prompt, num_generated,
            pb.KVTransferParams(role="decode", mode=mode, transfer_id=xid, peer=p.kv_endpoint),
            pb.KVTransferParams(role="prefill", mode=mode, transfer_id=xid, peer=d.kv_endpoint))
        return PairedLegs(self._leg(PrefillLeg, p, prefill_request),
                          self._leg(DecodeLeg, d, decode_request))

    def _leg(self, kind: type[Leg], engine: EngineEndpoint, request: pb.GenerateRequest):
        return kind(engine, request, self.deps.registry.engine(engine.address), self.timings,
                    self.deps.aborter, self.deadlines)


def _is_full(plan: Plan) -> bool:
    """Some engine of ``plan`` answered "full" a moment ago: the router found none better."""
    now = time.monotonic()
    return any(e.is_full(now) for e in plan.engines())
