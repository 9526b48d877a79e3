"""A request's life from routing to its last token: attempts, retries, continuation.

``RequestRun.tokens()`` yields the output token ids as the engines produce them.
Each attempt asks the router for a plan and runs its legs (``legs.py``): a PD pair
(``PairedLegs``: the decode leg is sent first, then the prefill leg with the same
transfer id) or one engine (``Leg``).

Failures (``LegFailure``): P fails before handoff, or D before its first token:
the attempt is retried on other engines. D fails mid-stream: the request goes on
on a new plan whose prompt is the original prompt plus every token already
streamed and whose ``max_tokens`` is what is left, so the client's stream
continues without a visible break. At most ``max_retries`` retries with bounded
exponential backoff; everything (routing waits, calls, backoff) lives inside the
request's one deadline.

``GenerationParams`` is what the client asked for, fixed at arrival;
``GenerationParams.engine_request`` is the one place it becomes the engine's
``GenerateRequest``, for the first attempt and for a continuation alike.

Invariants: an attempt's legs are closed before the next attempt starts and when
the run is closed (stop string, client gone: closing the generator runs the
``finally``), which cancels and aborts the legs that did not finish.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.api.proto import engine_pb2 as pb

from .errors import ServeError
from .instances import EngineEndpoint, InstanceRegistry
from .legs import Aborter, DecodeLeg, Leg, LegFailure, PairedLegs, PrefillLeg
from .metrics import CoordinatorMetrics
from .policies import RouteContext
from .router import Plan, Router
from .settings import CoordinatorSettings
from .timings import RequestTimings


@dataclass
class Deps:
    """What every request needs; built once by ``create_app``."""

    settings: CoordinatorSettings
    registry: InstanceRegistry
    router: Router
    metrics: CoordinatorMetrics
    aborter: Aborter


@dataclass(frozen=True)
class GenerationParams:
    """Sampling and length limits of one request; built by ``serving.build_generation_params``."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    def engine_request(self, leg_id: str, prompt_ids: list[int], num_generated: int,
                       kv_transfer: pb.KVTransferParams | None = None) -> pb.GenerateRequest:
        """One leg's request. ``prompt_ids`` is the original prompt followed by the
        ``num_generated`` tokens already streamed: the leg asks for what is left and
        samples from where the stream stands (a seeded stream draws the same numbers)."""
        return pb.GenerateRequest(
            request_id=leg_id, prompt_token_ids=prompt_ids, kv_transfer=kv_transfer,
            sampling=pb.SamplingParams(
                max_tokens=self.max_tokens - num_generated, temperature=self.temperature,
                top_p=self.top_p, seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
                sample_offset=num_generated, min_tokens=max(0, self.min_tokens - num_generated)))


class RequestRun:
    """One request's attempts; built by serving, iterated through ``tokens`` on the event loop."""

    def __init__(self, deps: Deps, request_id: str, prompt_ids: list[int], params: GenerationParams,
                 deadline: float, arrival_s: float | None = None) -> None:
        self.deps = deps
        self.arrival_s = time.monotonic() if arrival_s is None else arrival_s
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.deadline = deadline
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.timings = RequestTimings(request_id, deps.metrics)
        self.num_attempts = 0

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    async def tokens(self) -> AsyncIterator[list[int]]:
        """Called by serving; iterate to the end or close it (stop string, client gone)."""
        s = self.deps.settings
        exclude: set[str] = set()
        failures = 0
        while True:
            if len(self.generated) >= self.params.max_tokens:
                self.finish_reason = "length"
                return
            prompt = self.prompt_ids + self.generated
            plan = await self.deps.router.plan(RouteContext(prompt, s.block_size), exclude,
                                               self.deadline)
            self.num_attempts += 1
            self.timings.report["attempts"] = self.num_attempts
            if self.num_attempts == 1:  # arrival -> first leg sent: tokenize, admit, route
                self.timings.observe("route", time.monotonic() - self.arrival_s)
            legs = self._legs(plan, prompt)
            try:
                try:
                    left = self.left_s()
                    if left <= 0:
                        raise ServeError(504, "the request's deadline passed", code="deadline")
                    legs.start(left)
                    async for ids in legs.tokens():
                        self.generated.extend(ids)
                        yield ids
                finally:
                    legs.close()
                self.finish_reason = legs.finish_reason
                return
            except LegFailure as f:
                failures += 1
                self.deps.metrics.retries.labels(f.leg, f.stage).inc()
                if f.stage == "mid_stream":
                    self.deps.metrics.continuations.inc()
                self.deps.registry.mark_failed(f.engine.instance_id)
                exclude.add(f.engine.instance_id)
                if failures > s.max_retries:
                    raise ServeError(502, f"gave up after {failures} failed attempts; last: {f}",
                                     code="engine_failure") from None
                backoff = min(s.retry_backoff_s * 2 ** (failures - 1), s.retry_backoff_max_s)
                if backoff >= self.left_s():
                    raise ServeError(504, f"deadline passed while retrying after: {f}",
                                     code="deadline") from None
                await asyncio.sleep(backoff)

    def _legs(self, plan: Plan, prompt: list[int]) -> Leg | PairedLegs:
        # Engines refuse a reused id; attempts after the first get a suffix.
        n = self.num_attempts
        leg_id = self.request_id if n == 1 else f"{self.request_id}.{n}"
        num_generated = len(self.generated)
        report = self.timings.report
        if plan.kind != "pd":
            report["prefill_instance"] = report["decode_instance"] = plan.single.address
            return self._leg(Leg, plan.single, self.params.engine_request(leg_id, prompt, num_generated))
        p, d = plan.prefill, plan.decode
        report["prefill_instance"], report["decode_instance"] = p.address, d.address
        mode, xid = self.deps.settings.kv_mode, f"x-{leg_id}"
        decode = self._leg(DecodeLeg, d, self.params.engine_request(
            leg_id, prompt, num_generated, pb.KVTransferParams(
                role="decode", mode=mode, transfer_id=xid, peer=p.kv_endpoint)))
        prefill = self._leg(PrefillLeg, p, self.params.engine_request(
            leg_id, prompt, num_generated, pb.KVTransferParams(
                role="prefill", mode=mode, transfer_id=xid, peer=d.kv_endpoint)))
        return PairedLegs(prefill, decode)

    def _leg(self, kind: type[Leg], engine: EngineEndpoint, request: pb.GenerateRequest):
        return kind(engine, request, self.deps.registry.client(engine.address), self.timings,
                    self.deps.aborter)
