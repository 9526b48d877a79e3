"""The engine's gRPC server (``pdserve.engine.v1.Engine``) and its orderly shutdown.

The asyncio server owns the network; ``EngineLoop`` owns the engine. ProbePeer
starts a KV connector probe of a peer's KV endpoint (kv_transfer/probe.py) on the
loop thread and answers with its result. A Generate
call submits the request, waits for admission (bad input → INVALID_ARGUMENT with the
engine's message, logged at INFO without a traceback), then streams outputs from an
asyncio queue fed by the loop thread through ``Handoff``: the outputs of one step cross
to the event loop together, one wake-up for the step rather than one per request. A
call that ends early (client gone, RPC cancelled, even during admission) aborts its
own request and no other, so its KV
blocks are freed at once. The Abort RPC ends a request's stream with a last message
(``finish_reason`` "abort"). A session (the Coordinator's one connection per engine,
on the session port) runs this same Generate for each request it carries
(``session_server.py``).

How a stream ends is decided in one place, ``end_status``: a request the engine had
no room for (``finish_reason`` "full": D found no KV blocks within its reserve wait,
or P heard so from D) ends with status RESOURCE_EXHAUSTED and details starting
"decode full", the Coordinator's sign of load; every other end, errors included, is
a last message with ``finished`` set.

Shutdown (SIGTERM or SIGINT, the same path)::

    serving ──signal──▶ draining: new requests UNAVAILABLE, Health/Stats still answer
       in-flight requests and transfers finish, for at most ``shutdown_grace_s``
       (a second signal cuts the grace short)
    ──▶ the rest end with an error message on their streams
    ──▶ gRPC and metrics servers stop ──▶ loop stops ──▶ engine.close(): the KV connector
        and its transport close, the KV shm segment is unlinked
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import signal
import time
import uuid

import grpc

from pdserve.api.proto import engine_pb2 as pb
from pdserve.api.proto import engine_pb2_grpc as pb_grpc
from pdserve.api.sampling import SamplingParams
from pdserve.engine.admission import EngineInputError, EngineUnavailable
from pdserve.engine.kv_transfer.messages import DECODE_FULL
from pdserve.engine.kv_transfer.params import KVTransferParams
from pdserve.engine.kv_transfer.probe import ProbeResult
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loop import EngineLoop
from pdserve.engine.metrics import attach_metrics, start_metrics_server
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import RequestStatus, TokenLogprob
from pdserve.engine.session_server import FrameSessionServer
from pdserve.runtime.security import SecuritySettings, add_port, server_interceptors

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0  # ProbePeer's default when the request names none


def sampling_from_proto(msg: pb.SamplingParams, has_sampling: bool) -> SamplingParams:
    if not has_sampling:
        return SamplingParams()
    if msg.n > 1:  # the wire has the field; the engine does not fork choices yet
        raise ValueError(f"n > 1 is not supported yet (got {msg.n})")
    return SamplingParams.from_proto(msg)


def output_to_proto(out: RequestOutput) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=out.request_id,
        token_ids=out.new_token_ids,
        text=out.new_text,
        finished=out.finished,
        finish_reason=out.finish_reason or "",
        num_prompt_tokens=out.num_prompt_tokens,
        num_output_tokens=out.num_output_tokens,
        num_cached_tokens=out.num_cached_tokens,
        error=out.error or "",
        timings=pb.Timings(**out.timings) if out.timings else None,
        logprobs=_logprobs_to_proto(out.logprobs),
        prompt_logprobs=_logprobs_to_proto(out.prompt_logprobs),
    )


def _logprobs_to_proto(entries: list[TokenLogprob] | None) -> list[pb.TokenLogprob] | None:
    if not entries:
        return None
    return [pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top])
            for e in entries]


def end_status(out: RequestOutput) -> tuple[grpc.StatusCode, str] | None:
    """The status a stream ends with instead of sending ``out``; None: send it."""
    if out.finished and out.finish_reason == RequestStatus.FINISHED_FULL.value:
        return grpc.StatusCode.RESOURCE_EXHAUSTED, out.error or DECODE_FULL
    return None


class Handoff:
    """Outputs from the engine's loop thread to their requests' queues on the event loop.

    ``put`` (the loop thread) appends to a deque and asks the event loop to drain it
    only when no drain is pending, so the outputs a step delivers in one go share one
    ``call_soon_threadsafe`` (a wake-up write and a callback) instead of one each: per
    output, 3-4 µs of CPU against 9-14 (docs/benchmarks.md). ``_drain`` clears the flag
    before it takes anything, so an output put while it runs is either taken by it or
    has a drain of its own; each queue gets its outputs in the order they were put."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: collections.deque[tuple[asyncio.Queue, RequestOutput]] = collections.deque()
        self._drain_asked = False

    def put(self, outputs: asyncio.Queue, out: RequestOutput) -> None:
        self._pending.append((outputs, out))
        if not self._drain_asked:
            self._drain_asked = True
            with contextlib.suppress(RuntimeError):  # the event loop is already closed
                self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self._drain_asked = False
        pending = self._pending
        while pending:
            outputs, out = pending.popleft()
            outputs.put_nowait(out)


class EngineService(pb_grpc.EngineServicer):
    """The Engine service; the session port runs its ``Generate`` per request (session_server.py)."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.session_port = 0  # set by ``serve`` once the session port listens
        self._handoff: Handoff | None = None  # made on its event loop by the first Generate

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id or f"req-{uuid.uuid4().hex[:12]}"
        try:
            params = sampling_from_proto(request.sampling, request.HasField("sampling"))
        except (TypeError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        handoff, aio_loop = self._handoff, asyncio.get_running_loop()
        if handoff is None or handoff.loop is not aio_loop:
            handoff = self._handoff = Handoff(aio_loop)
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:  # the loop thread
            handoff.put(outputs, out)

        kv = None
        if request.HasField("kv_transfer"):
            k = request.kv_transfer
            kv = KVTransferParams(role=k.role, mode=k.mode, transfer_id=k.transfer_id, peer=k.peer)
        admitted = self.loop.submit(
            rid, list(request.prompt_token_ids) or None, request.prompt or None, params, sink, kv
        )
        finished = False
        try:
            try:
                await asyncio.wrap_future(admitted)
            except EngineInputError as exc:
                log.info("request %s refused: %s", rid, exc)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except EngineUnavailable as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            while not finished:
                out = await outputs.get()
                finished = out.finished
                status = end_status(out)
                if status is not None:
                    await context.abort(*status)
                yield output_to_proto(out)
        finally:
            if not finished:  # refused, the client went away, or the call was cancelled
                self.loop.abort(rid, owner=sink)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        ended = await asyncio.wrap_future(self.loop.abort(request.request_id))
        return pb.AbortResponse(aborted=bool(ended))

    async def Health(self, request, context) -> pb.HealthResponse:
        engine = self.loop.engine
        kv = engine.connector.describe() if engine.connector is not None else {"kv_transport": "none"}
        return pb.HealthResponse(
            serving=True, role=engine.config.role, model=engine.model_config.name,
            device=engine.config.device, draining=engine.draining, time_unix_s=time.time(),
            max_model_len=engine.max_model_len, session_port=self.session_port, **kv,
        )

    async def ProbePeer(self, request: pb.ProbePeerRequest, context) -> pb.ProbePeerResponse:
        """Starts a connector probe on the loop thread and waits for its result; the
        probe ends within ``timeout_s`` (probe.py), so this always answers."""
        timeout_s = request.timeout_s if request.timeout_s > 0 else PROBE_TIMEOUT_S
        aio_loop = asyncio.get_running_loop()
        ended: asyncio.Future[ProbeResult] = aio_loop.create_future()

        def done(result: ProbeResult) -> None:  # the loop thread
            def settle() -> None:
                if not ended.done():
                    ended.set_result(result)

            with contextlib.suppress(RuntimeError):  # the event loop is already closed
                aio_loop.call_soon_threadsafe(settle)

        engine = self.loop.engine
        await asyncio.wrap_future(self.loop.call(
            lambda e: e.probe_peer(request.endpoint, request.test_transfer, timeout_s, done)))
        try:
            result = await asyncio.wait_for(ended, timeout_s + 5.0)
        except TimeoutError:
            result = ProbeResult(False, "the engine did not finish the probe (engine loop stuck?)")
        kv = engine.connector.describe() if engine.connector is not None else {}
        return pb.ProbePeerResponse(
            ok=result.ok, reason=result.reason, handshake_s=result.handshake_s,
            transfer_s=result.transfer_s, transfer_bytes=result.transfer_bytes,
            peer_compat_hash=result.peer_compat_hash, compat_hash=kv.get("kv_compat_hash", ""),
            transport=kv.get("kv_transport", "none"),
        )

    async def KVEvents(self, request: pb.KVEventsRequest, context):
        """The prefix cache's events (kv_events.py) until the caller goes away."""
        events, block_size = self.loop.engine.kv_events, self.loop.engine.block_manager.block_size
        aio_loop = asyncio.get_running_loop()
        new = asyncio.Event()

        def wake() -> None:  # any thread
            with contextlib.suppress(RuntimeError):  # the event loop is already closed
                aio_loop.call_soon_threadsafe(new.set)

        reader = events.subscribe(wake)
        epoch, seq = request.epoch, request.since_seq
        try:
            while True:
                batch = events.read(reader, epoch, seq)
                if batch is None:
                    await new.wait()
                    new.clear()
                    continue
                epoch, seq = batch.epoch, batch.seq
                yield pb.KVEventBatch(epoch=batch.epoch, seq=batch.seq, snapshot=batch.snapshot,
                                      stored=batch.stored, removed=batch.removed,
                                      block_size=block_size)
        finally:
            events.unsubscribe(reader)

    async def Drain(self, request: pb.DrainRequest, context) -> pb.DrainResponse:
        def drain(engine: LLMEngine):
            engine.draining = not request.resume
            return engine.draining, engine.scheduler.num_unfinished

        draining, unfinished = await asyncio.wrap_future(self.loop.call(drain))
        return pb.DrainResponse(draining=draining, num_unfinished=unfinished)

    async def SetRole(self, request: pb.SetRoleRequest, context) -> pb.SetRoleResponse:
        try:
            await asyncio.wrap_future(self.loop.call(lambda e: e.set_role(request.role)))
        except EngineInputError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineUnavailable as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.SetRoleResponse(role=self.loop.engine.config.role)

    async def Stats(self, request, context) -> pb.StatsResponse:
        return self.loop.snapshot  # never queued behind a step: a busy engine answers


async def serve(
    engines: list[LLMEngine], host: str, port: int, ready=None, security: SecuritySettings | None = None,
    metrics_port: int | None = None, metrics_ready=None, shutdown_grace_s: float = 10.0,
    session_port: int = 0,
) -> None:
    """Serve ``engines`` (one, or several simulated ones sharing this process) until SIGTERM
    or SIGINT, then shut them all down together, in order (module docstring); cancelled,
    it skips the grace. Each engine has servers of its own: engine ``i`` listens on
    ``port + i`` (each on a free port when ``port`` is 0), and likewise on its session
    port and, with ``metrics_port``, serves its Prometheus metrics over HTTP.
    ``metrics_ready(i, port)`` and then ``ready(i, port)`` are called as each engine
    listens, in the list's order. Main thread only (signals)."""
    security = security or SecuritySettings()
    served = [ServedEngine(engine) for engine in engines]
    # the handlers first: a signal that comes as soon as "ready" is printed shuts down in order
    stop, hurry = asyncio.Event(), asyncio.Event()
    aio_loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aio_loop.add_signal_handler(sig, lambda: hurry.set() if stop.is_set() else stop.set())
    try:
        for i, one in enumerate(served):
            await one.start(host, port and port + i, security,
                            None if metrics_port is None else metrics_port and metrics_port + i,
                            session_port and session_port + i)
            if metrics_ready is not None and one.metrics_port:
                metrics_ready(i, one.metrics_port)
            if ready is not None:
                ready(i, one.port)
        await stop.wait()
        await asyncio.gather(*(shut_down(one.loop, shutdown_grace_s, hurry) for one in served))
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            aio_loop.remove_signal_handler(sig)
        await asyncio.gather(*(one.stop() for one in served))


class ServedEngine:
    """One engine's loop and servers (gRPC, sessions, metrics), started and stopped by
    ``serve``. ``stop`` undoes whatever ``start`` got to, even a start that failed, and
    closes the engine (started or not)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.metrics = attach_metrics(engine)
        self.loop = EngineLoop(engine)
        self.port = self.metrics_port = 0
        self._stack = contextlib.AsyncExitStack()
        self._stack.callback(engine.close)

    async def start(self, host: str, port: int, security: SecuritySettings, metrics_port: int | None,
                    session_port: int) -> None:
        self._stack.pop_all()  # the loop closes the engine when it stops
        self.loop.start()
        self._stack.callback(self.loop.stop)  # last: closes the engine
        if metrics_port is not None:
            runner, self.metrics_port = await start_metrics_server(self.loop, self.metrics, host, metrics_port)
            self._stack.push_async_callback(runner.cleanup)
        server = grpc.aio.server(
            options=[("grpc.so_reuseport", 0)], interceptors=server_interceptors(security)
        )
        service = EngineService(self.loop)
        pb_grpc.add_EngineServicer_to_server(service, server)
        self.port = add_port(server, f"{host}:{port}", security)
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        sessions = FrameSessionServer(service, security)
        service.session_port = await sessions.start(host, session_port)
        self._stack.push_async_callback(sessions.close)
        await server.start()
        # First on the way out; its grace lets the last messages of ended streams go out.
        self._stack.push_async_callback(server.stop, 1.0)

    async def stop(self) -> None:
        await self._stack.aclose()


async def shut_down(loop: EngineLoop, grace_s: float, hurry: asyncio.Event) -> None:
    """Stop admitting, give in-flight work ``grace_s`` (or until ``hurry``), then end
    every request still live with an error. Called once by ``serve``."""
    started_s = time.monotonic()
    log.info("shutting down: admitting no new requests; in-flight ones have %g s", grace_s)
    await asyncio.wrap_future(loop.call(_stop_admitting))
    while not loop.is_idle and not hurry.is_set() and time.monotonic() - started_s < grace_s:
        await asyncio.sleep(0.05)
    if not loop.is_idle:
        message = f"the engine shut down before the request finished ({grace_s:g} s grace)"
        num_failed = await asyncio.wrap_future(loop.fail_all(message))
        log.warning("shutdown: ended %d unfinished requests with an error", num_failed)
    log.info("shutdown: drained in %.2f s", time.monotonic() - started_s)


def _stop_admitting(engine: LLMEngine) -> None:
    engine.draining = True
