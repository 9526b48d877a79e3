"""A request's life from routing to its last token: legs, retries, continuation, timings.

``RequestRun.tokens()`` yields the output token ids as the engines produce them.
Each attempt asks the router for a plan and runs it: a PD pair (the decode leg is
sent first, then the prefill leg with the same transfer id) or a single engine.

Failures (``LegFailure``): P fails before handoff, or D before its first token:
the attempt is retried on other engines. D fails mid-stream: the request goes on
on a new plan whose prompt is the original prompt plus every token already
streamed and whose ``max_tokens`` is what is left, so the client's stream
continues without a visible break. At most ``max_retries`` retries with bounded
exponential backoff; everything (routing waits, calls, backoff) lives inside the
request's one deadline.

Invariants: a leg that did not finish is cancelled and aborted on its engine
(client disconnect included: closing the generator runs the ``finally``);
Coordinator-side load counters are restored on every exit path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from pdserve.api.engine_client import build_generate_request

from .errors import ServeError
from .instances import Instance, InstanceRegistry
from .legs import Aborter, LegFailure, classify_rpc_error, finish_failure
from .metrics import CoordinatorMetrics
from .policies import RouteContext
from .router import Plan, Router
from .settings import CoordinatorSettings


@dataclass
class Deps:
    """What every request needs; built once by ``create_app``."""

    settings: CoordinatorSettings
    registry: InstanceRegistry
    router: Router
    metrics: CoordinatorMetrics
    aborter: Aborter


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0


class RequestRun:
    def __init__(self, deps: Deps, request_id: str, prompt_ids: list[int], sampling: Sampling,
                 deadline: float, arrival_s: float | None = None) -> None:
        self.deps = deps
        self.arrival_s = time.monotonic() if arrival_s is None else arrival_s
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.deadline = deadline
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.timings: dict[str, float | int | str | None] = {"request_id": request_id}
        self.num_attempts = 0

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    async def tokens(self) -> AsyncIterator[list[int]]:
        """Called by the app; iterate to the end or close it (stop string, client gone)."""
        s = self.deps.settings
        exclude: set[str] = set()
        failures = 0
        while True:
            remaining = self.sampling.max_tokens - len(self.generated)
            if remaining <= 0:
                self.finish_reason = "length"
                return
            prompt = self.prompt_ids + self.generated
            ctx = RouteContext(prompt, s.block_size)
            plan = await self.deps.router.plan(ctx, exclude, self.deadline)
            self.num_attempts += 1
            self.timings["attempts"] = self.num_attempts
            try:
                if plan.kind == "pd":
                    legs = self._run_pd(plan, prompt, remaining)
                else:
                    legs = self._run_single(plan.single, prompt, remaining)
                async for ids in legs:
                    self.generated.extend(ids)
                    yield ids
                return
            except LegFailure as f:
                failures += 1
                self.deps.metrics.retries.labels(f.leg, f.stage).inc()
                if f.stage == "mid_stream":
                    self.deps.metrics.continuations.inc()
                self.deps.registry.mark_failed(f.instance.instance_id)
                exclude.add(f.instance.instance_id)
                if failures > s.max_retries:
                    raise ServeError(502, f"gave up after {failures} failed attempts; last: {f}",
                                     code="engine_failure") from None
                backoff = min(s.retry_backoff_s * 2 ** (failures - 1), s.retry_backoff_max_s)
                if backoff >= self.left_s():
                    raise ServeError(504, f"deadline passed while retrying after: {f}",
                                     code="deadline") from None
                await asyncio.sleep(backoff)

    def _leg_id(self) -> str:
        # Engines refuse a reused id; attempts after the first get a suffix.
        n = self.num_attempts
        return self.request_id if n == 1 else f"{self.request_id}.{n}"

    def _build(self, leg_id: str, prompt: list[int], max_tokens: int, kv: dict | None = None):
        sp = self.sampling
        return build_generate_request(
            leg_id, prompt_token_ids=prompt, max_tokens=max_tokens, temperature=sp.temperature,
            top_p=sp.top_p, seed=sp.seed, stop=sp.stop, kv_transfer=kv,
            sample_offset=len(self.generated), ignore_eos=sp.ignore_eos,
            min_tokens=max(0, sp.min_tokens - len(self.generated)),
        )

    def _call(self, inst: Instance, request):
        if "route_s" not in self.timings:  # arrival -> first leg sent: tokenize, admit, route
            self._observe("route", "route_s", time.monotonic() - self.arrival_s)
        left = self.left_s()
        if left <= 0:
            raise ServeError(504, "the request's deadline passed", code="deadline")
        return self.deps.registry.client(inst.address).generate(request, timeout_s=left)

    async def _run_single(self, inst: Instance, prompt: list[int], max_tokens: int):
        leg_id = self._leg_id()
        self.timings["prefill_instance"] = self.timings["decode_instance"] = inst.address
        call = self._call(inst, self._build(leg_id, prompt, max_tokens))
        inst.num_inflight += 1
        pending = len(prompt)  # counted in the engine's pending prefill until its first token
        inst.num_pending_prefill_tokens += pending
        finished = got = False
        try:
            async for msg in call:
                if msg.finished and msg.finish_reason not in ("stop", "length"):
                    raise finish_failure(msg, inst, "single", "mid_stream" if got else "before_first_token")
                if not got and msg.HasField("timings"):
                    self._prefill_timings(inst, msg.timings, len(prompt))
                    inst.num_pending_prefill_tokens -= pending
                    pending = 0
                if msg.token_ids:
                    got = True
                    yield list(msg.token_ids)
                if msg.finished:
                    finished = True
                    self.finish_reason = msg.finish_reason
                    return
            raise LegFailure(inst, "single", "mid_stream", "stream ended without finishing")
        except grpc.aio.AioRpcError as exc:
            raise classify_rpc_error(exc, inst, "single", "mid_stream" if got else "before_first_token") from None
        finally:
            inst.num_inflight -= 1
            inst.num_pending_prefill_tokens -= pending
            if not finished:
                call.cancel()
                self.deps.aborter.abort_soon(inst, leg_id)

    async def _run_pd(self, plan: Plan, prompt: list[int], max_tokens: int):
        p, d = plan.prefill, plan.decode
        mode = self.deps.settings.kv_mode
        leg_id = self._leg_id()
        xid = f"x-{leg_id}"
        self.timings["prefill_instance"], self.timings["decode_instance"] = p.address, d.address
        d_call = self._call(d, self._build(leg_id, prompt, max_tokens, {
            "role": "decode", "mode": mode, "transfer_id": xid, "peer": p.kv_endpoint}))
        p_call = self._call(p, self._build(leg_id, prompt, max_tokens, {
            "role": "prefill", "mode": mode, "transfer_id": xid, "peer": d.kv_endpoint}))
        d.num_inflight += 1
        p.num_inflight += 1
        p.num_pending_prefill_tokens += len(prompt)
        p_state = {"pending": len(prompt)}
        p_task = asyncio.ensure_future(self._prefill_leg(p, p_call, p_state))
        finished = got = False
        try:
            stream = d_call.__aiter__()
            while True:
                try:
                    msg = await self._next_decode(stream, p_task, got)
                except StopAsyncIteration:
                    raise LegFailure(d, "decode", "mid_stream" if got else "before_first_token",
                                     "stream ended without finishing") from None
                except grpc.aio.AioRpcError as exc:
                    raise classify_rpc_error(exc, d, "decode", "mid_stream" if got else "before_first_token") from None
                if msg.finished and msg.finish_reason not in ("stop", "length"):
                    raise finish_failure(msg, d, "decode", "mid_stream" if got else "before_first_token")
                if not got and msg.HasField("timings"):
                    self._observe("decode_wait", "decode_wait_s", msg.timings.kv_wait_s)
                    self._observe("decode_queue", "decode_queue_s", msg.timings.decode_queue_s)
                if msg.token_ids:
                    got = True
                    yield list(msg.token_ids)
                if msg.finished:
                    finished = True
                    self.finish_reason = msg.finish_reason
                    return
        finally:
            d.num_inflight -= 1
            p.num_inflight -= 1
            p.num_pending_prefill_tokens -= p_state["pending"]
            if not finished:
                d_call.cancel()
                self.deps.aborter.abort_soon(d, leg_id)
            if p_task.done():
                if not p_task.cancelled():
                    p_task.exception()  # retrieved: a P failure after D's end is moot
            elif finished:
                # D decoded to the end, so P's transfer completed; its "handoff" message
                # is on its way. Let the leg end by itself: no Abort RPC on the hot path.
                p_task.add_done_callback(_retrieve)
            else:
                p_task.cancel()
                p_call.cancel()
                self.deps.aborter.abort_soon(p, leg_id)

    async def _next_decode(self, stream, p_task: asyncio.Future, got: bool):
        """D's next message; a P failure before D's first token wins (D only waits for KV)."""
        if p_task.done():
            return await stream.__anext__()
        nxt = asyncio.ensure_future(stream.__anext__())
        await asyncio.wait((nxt, p_task), return_when=asyncio.FIRST_COMPLETED)
        if not got and p_task.done() and not p_task.cancelled() and p_task.exception() is not None:
            if not nxt.done():
                nxt.cancel()
            raise p_task.exception()
        return await nxt

    async def _prefill_leg(self, p: Instance, call, state: dict) -> None:
        got = False
        try:
            async for msg in call:
                if not got and msg.HasField("timings"):
                    got = True
                    self._prefill_timings(p, msg.timings, state["pending"])
                    p.num_pending_prefill_tokens -= state["pending"]
                    state["pending"] = 0
                if msg.finished:
                    if msg.finish_reason == "handoff":
                        self._observe("kv_transfer", "kv_transfer_s", msg.timings.kv_transfer_s)
                        return
                    raise finish_failure(msg, p, "prefill", "before_handoff")
            raise LegFailure(p, "prefill", "before_handoff", "stream ended without handoff")
        except grpc.aio.AioRpcError as exc:
            raise classify_rpc_error(exc, p, "prefill", "before_handoff") from None

    def _prefill_timings(self, inst: Instance, t, num_tokens: int) -> None:
        self._observe("prefill_queue", "prefill_queue_s", t.queue_s)
        self._observe("prefill_compute", "prefill_compute_s", t.prefill_s)
        if t.prefill_s > 0 and num_tokens:
            rate = num_tokens / t.prefill_s
            old = inst.prefill_tokens_per_s
            inst.prefill_tokens_per_s = rate if old == 0 else 0.8 * old + 0.2 * rate

    def _observe(self, stage: str, key: str, seconds: float) -> None:
        # Across a retry, stages add up: the client waited for all of them.
        self.timings[key] = float(self.timings.get(key) or 0.0) + seconds
        self.deps.metrics.observe_stage(stage, seconds)


def _retrieve(task: asyncio.Future) -> None:
    """Done callback for a leg left to finish alone: its outcome no longer matters."""
    if not task.cancelled():
        task.exception()
