"""A stand-in engine for the Coordinator's tests and benchmark: the Engine gRPC service
answering at once, with no model behind it.

``behavior``: "ok" answers each Generate with ``num_tokens`` tokens (``token_ids``
cycled, default A, B, C, ...) in all, from the request's ``sample_offset``: a
continuation goes on with the letters after those already streamed and ends where
the whole answer would, ``token_delay_s`` apart, with one pause of
``stall_s`` more before token ``stall_after`` (an engine stalled mid-stream); a
prefill leg: the first token, then "handoff", both ``prefill_delay_s`` late (a
decode leg can finish first); "fail" ends the first ``num_fail`` Generate calls (None:
all; then it answers as "ok") with an engine error after ``fail_after`` tokens (0:
before any), as a crashing engine's leg would look to the
Coordinator; "full" refuses the first ``num_full`` Generate calls (None: all) as an
engine with no room does, then answers as "ok"; "refuse" refuses every Generate
with INVALID_ARGUMENT, as an engine does a prompt longer than its context. Health reports the given role, KV
endpoint and compat hash, so a stub can be paired with real engines. ProbePeer
passes for every peer except those in ``probe_failures`` (KV endpoint -> reason);
``probed`` lists the endpoints asked. Stats reports ``num_waiting`` and
``num_kv_blocks_free`` (of 64), which a test may change as it runs.

Like a real engine it refuses (INVALID_ARGUMENT) a request id already in flight and
a transfer id longer than 128 characters, and Abort ends the stream of the request
it names. Its session port, which ``start_stub`` opens and Health names,
serves this Generate per request, as the engine's does (``pdserve.engine.session_server``). ``request_ids`` lists every Generate's request
id, ``aborted`` every Abort's, ``max_inflight`` the most requests it held at once.

The "full" answer is the engine contract the Coordinator implements
(``coordinator/legs.py``): gRPC status RESOURCE_EXHAUSTED, details starting
"decode full" (a decode leg: no KV blocks to reserve) or "prefill full" (a prefill
or single leg), sent before any response message.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from pdserve.api.proto import engine_pb2 as pb
from pdserve.api.proto import engine_pb2_grpc as pb_grpc
from pdserve.engine.session_server import FrameSessionServer

MAX_TRANSFER_ID_CHARS = 128  # as pdserve.engine.kv_transfer.params


class StubEngine(pb_grpc.EngineServicer):
    def __init__(self, role: str = "hybrid", behavior: str = "ok", num_tokens: int = 1,
                 kv_compat_hash: str = "stub", kv_endpoint: str = "127.0.0.1:1",
                 fail_after: int = 0, token_delay_s: float = 0.0,
                 token_ids: list[int] | None = None, num_full: int | None = None,
                 probe_failures: dict[str, str] | None = None, max_model_len: int = 0,
                 num_cached_tokens: int = 0, stall_after: int = 0, stall_s: float = 0.0,
                 prefill_delay_s: float = 0.0, num_fail: int | None = None,
                 num_waiting: int = 0, num_kv_blocks_free: int = 64) -> None:
        self.role, self.behavior, self.num_tokens = role, behavior, num_tokens
        self.max_model_len, self.num_cached_tokens = max_model_len, num_cached_tokens
        self.kv_compat_hash, self.kv_endpoint = kv_compat_hash, kv_endpoint
        self.fail_after, self.num_fail = fail_after, num_fail
        self.num_failed = 0
        self.token_delay_s = token_delay_s
        self.stall_after, self.stall_s = stall_after, stall_s
        self.prefill_delay_s = prefill_delay_s
        self.token_ids = token_ids or [65 + i for i in range(26)]
        self.num_full = num_full
        self.num_waiting, self.num_kv_blocks_free = num_waiting, num_kv_blocks_free  # Stats
        self.num_refused_full = 0
        self.request_ids: list[str] = []
        self.aborted: list[str] = []
        self.max_inflight = 0
        self.probe_failures = probe_failures or {}
        self.probed: list[str] = []
        self.session_port = 0  # set by ``start_stub``
        self._inflight: dict[str, asyncio.Event] = {}  # request id -> set by Abort

    async def Generate(self, request: pb.GenerateRequest, context):
        rid = request.request_id
        self.request_ids.append(rid)
        leg = request.kv_transfer.role if request.HasField("kv_transfer") else ""
        if rid in self._inflight:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is already in use")
        if len(request.kv_transfer.transfer_id) > MAX_TRANSFER_ID_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"kv_transfer.transfer_id must be 1-{MAX_TRANSFER_ID_CHARS} characters")
        if self.behavior == "refuse":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "the prompt is longer than the model's context (stub)")
        if self.behavior == "full" and (self.num_full is None or self.num_refused_full < self.num_full):
            self.num_refused_full += 1
            side = "decode" if leg == "decode" else "prefill"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{side} full: no free KV blocks for the request (stub)")
        if self.behavior == "peer_full" and leg == "prefill":
            # What a real P answers when its D gave up reserving: D's refusal, relayed.
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"decode full (peer {request.kv_transfer.peer})")
        aborted = self._inflight[rid] = asyncio.Event()
        self.max_inflight = max(self.max_inflight, len(self._inflight))
        try:
            async for response in self._respond(request, leg, aborted):
                yield response
        finally:
            del self._inflight[rid]

    async def _respond(self, request: pb.GenerateRequest, leg: str, aborted: asyncio.Event):
        rid, n_prompt = request.request_id, len(request.prompt_token_ids)
        offset = request.sampling.sample_offset  # a continuation goes on where its stream was
        if self.behavior == "fail" and (self.num_fail is None or self.num_failed < self.num_fail):
            self.num_failed += 1
            for i in range(self.fail_after):
                yield pb.GenerateResponse(request_id=rid, token_ids=[self._token(offset + i)])
            yield pb.GenerateResponse(request_id=rid, finished=True,
                                      finish_reason="error", error="stub engine fails on purpose")
            return
        timings = pb.Timings(queue_s=0.0, prefill_s=0.0)
        if leg == "prefill":
            await _pause(aborted, self.prefill_delay_s)
            if aborted.is_set():
                yield pb.GenerateResponse(request_id=rid, finished=True, finish_reason="abort")
                return
            yield pb.GenerateResponse(request_id=rid, token_ids=[self._token(offset)],
                                      num_prompt_tokens=n_prompt, timings=timings,
                                      num_cached_tokens=self.num_cached_tokens)
            yield pb.GenerateResponse(request_id=rid, finished=True,
                                      finish_reason="handoff", timings=pb.Timings())
            return
        n = max(1, min(self.num_tokens - offset, request.sampling.max_tokens or 16))
        for i in range(n):
            await _pause(aborted, self.token_delay_s + (self.stall_s if i == self.stall_after else 0))
            if aborted.is_set():
                yield pb.GenerateResponse(request_id=rid, finished=True, finish_reason="abort")
                return
            last = i == n - 1
            yield pb.GenerateResponse(
                request_id=rid, token_ids=[self._token(offset + i)], finished=last,
                finish_reason="length" if last else "", num_prompt_tokens=n_prompt,
                num_output_tokens=i + 1, timings=timings if i == 0 else None,
                num_cached_tokens=self.num_cached_tokens,
            )

    def _token(self, i: int) -> int:
        return self.token_ids[i % len(self.token_ids)]

    async def Abort(self, request, context) -> pb.AbortResponse:
        self.aborted.append(request.request_id)
        event = self._inflight.get(request.request_id)
        if event is not None:
            event.set()
        return pb.AbortResponse(aborted=event is not None)

    async def Health(self, request, context) -> pb.HealthResponse:
        return pb.HealthResponse(serving=True, role=self.role, model="tiny", device="cpu",
                                 kv_transport="tcp", kv_endpoint=self.kv_endpoint,
                                 kv_compat_hash=self.kv_compat_hash,
                                 max_model_len=self.max_model_len, session_port=self.session_port)

    async def KVEvents(self, request, context):
        """Publishes nothing (as an engine without KV events): routing uses routed prefixes."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the stub engine publishes no KV events")
        yield  # a stream handler

    async def ProbePeer(self, request, context) -> pb.ProbePeerResponse:
        self.probed.append(request.endpoint)
        reason = self.probe_failures.get(request.endpoint)
        return pb.ProbePeerResponse(ok=reason is None, reason=reason or "", handshake_s=0.001,
                                    compat_hash=self.kv_compat_hash, transport="tcp")

    async def Stats(self, request, context) -> pb.StatsResponse:
        return pb.StatsResponse(role=self.role, model="tiny", block_size=16,
                                num_waiting=self.num_waiting, num_kv_blocks_total=64,
                                num_kv_blocks_free=self.num_kv_blocks_free,
                                num_kv_blocks_used=64 - self.num_kv_blocks_free)


async def _pause(aborted: asyncio.Event, seconds: float) -> None:
    """``seconds``, or less when the request is aborted."""
    if seconds:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(aborted.wait(), seconds)


class StubServer:
    """The stub's gRPC server and, with ``sessions``, its session port: ``stop`` ends both."""

    def __init__(self, grpc_server: grpc.aio.Server, sessions: FrameSessionServer) -> None:
        self.grpc_server = grpc_server
        self.sessions = sessions

    async def stop(self, grace: float | None) -> None:
        await self.sessions.close()
        await self.grpc_server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


async def start_stub(stub: StubEngine, host: str = "127.0.0.1") -> tuple[StubServer, str]:
    """Serve ``stub`` on a free port in the running event loop, and its sessions as
    frames on another; returns (server, address)."""
    server = grpc.aio.server()
    pb_grpc.add_EngineServicer_to_server(stub, server)
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    frame_server = FrameSessionServer(stub)
    stub.session_port = await frame_server.start(host, 0)
    return StubServer(server, frame_server), f"{host}:{port}"
