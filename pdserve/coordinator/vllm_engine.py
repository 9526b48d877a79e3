"""The vLLM backend behind the engine interface: each leg one HTTP request to vLLM.

``VllmEngine`` (one per vLLM server, made by ``VllmBackend.connect``, which
``InstanceRegistry`` calls for a ``vllm://`` address) drives a vLLM OpenAI server as
``engines.Engine``; the field-by-field mapping is ``vllm_wire.py``, and docs/vllm.md
says which vLLM fields and functions it rests on. A leg's ``GenerateRequest`` becomes
one ``POST /v1/completions`` with the prompt as token ids and ``return_token_ids``;
what comes back becomes the engine API's own ``GenerateResponse`` messages, as
``legs.py`` expects them:

  single leg    streamed (SSE); one message per chunk with its token ids, the
                first with ``timings`` (prefill_s: sent -> first chunk), the last
                ``finished`` with vLLM's finish_reason. With prompt_logprobs (vLLM
                streams none) the answer is read whole and handed on as it is.
  prefill leg   ``max_tokens: 1`` and ``kv_transfer_params: {do_remote_decode:
                true}``, read whole (vLLM's streamed chunks carry no
                kv_transfer_params): a message with P's first token and ``timings``
                (vLLM's per-request metrics when it sends them), then a ``finished``
                one with finish_reason "handoff". P's kv_transfer_params go to the
                decode leg of the same ``kv_transfer.transfer_id`` through the
                backend's ``Handoffs``.
  decode leg    waits for P's kv_transfer_params (the call's first deadline bounds
                the wait), then streams as a single leg with them. vLLM's D samples
                the first token again from the pulled KV (greedy: P's token), so
                D's first message carries it (without its logprob: P's message scores
                it, as the embedded engine's D does), which ``PairedLegs`` drops when
                P's came first; its ``timings``: kv_wait_s (generate -> P's params),
                decode_queue_s (D's request sent -> its first chunk).

Errors (``engine_errors``): HTTP 400 (or an SSE error event with code 400) ->
``InputRefused``; 503 from vLLM's admission limits (--max-num-queued-reqs,
--max-num-queued-tokens: error type "Service Unavailable") -> ``EngineBusy``, "prefill
full: ..." on a prefill leg, "decode full: ..." on the others; the connection refused
or lost, any other status, a finish_reason "error" -> ``EngineFailed``; the call's
deadline -> ``DeadlinePassed``; ``cancel`` -> ``CallCancelled``. vLLM aborts a request
(and frees its KV) when its HTTP connection closes: ``cancel`` and ``abort`` close it.

Health and load (``runtime.vllm_server.VllmServer``): ``health`` is ``GET /health``
(200: serving), ``GET /v1/models`` (model, max_model_len) and the cache config of
``GET /metrics`` (block size and KV dtype, in the compat hash); ``stats`` parses
``GET /metrics``. vLLM does not say which pdserve role it has, its KV side channel or
connector: the address says (``vllm://HOST:PORT?role=...&kv=...&connector=...``, as
the NodeAgent reports it). ``probe_peer`` checks that P's side channel accepts a
connection (NIXL handshakes on a pair's first transfer); ``kv_events`` follows vLLM's
ZMQ publisher of prefix-cache events (the address's ``events``) into pdserve's hashes. The request's
``kv_transfer.mode`` is not read: NixlConnector pulls.

Invariants: a call ends once (its end, its deadline, its cancel, the engine's close);
its HTTP response is closed when it ends unfinished; a handoff nobody takes is
dropped after ``HANDOFF_KEEP_S`` (vLLM frees P's blocks at its own lease's end).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator

import aiohttp
import msgpack
import orjson
import zmq
import zmq.asyncio

from pdserve.api.proto import engine_pb2 as pb
from pdserve.runtime.vllm_server import VllmServer, VllmUnavailable, parse_vllm_address

from .engine_errors import (
    CallCancelled,
    DeadlinePassed,
    EngineCallError,
    EngineFailed,
    Unsupported,
)
from .engines import Engine, EngineCall
from .vllm_wire import (
    BlockMap,
    answer_messages,
    completion_body,
    error_of,
    http_error,
    logprobs_of,
    whole_timings,
)

log = logging.getLogger(__name__)
HANDOFF_KEEP_S = 30.0  # vLLM's default kv_lease_duration: P's blocks are gone after it
CONNECT_TIMEOUT_S = 5.0
KEEP_ALIVE_S = 3.0
# An SSE line may be long: the first chunk echoes the prompt's token ids (return_token_ids).
# aiohttp refuses a line over twice its read buffer.
READ_BUFSIZE = 1 << 22


class Handoffs:
    """P's ``kv_transfer_params`` by transfer id, for the decode leg of the same PD
    attempt; one per backend, shared by its engines. ``PairedLegs.start`` starts D's
    leg before P's, so D's wait is usually there first; a handoff put first waits
    ``HANDOFF_KEEP_S`` for its taker."""

    def __init__(self) -> None:
        self._futures: dict[str, asyncio.Future] = {}

    def __len__(self) -> int:
        return len(self._futures)

    def wait(self, transfer_id: str) -> asyncio.Future:
        """Called by a decode leg's ``generate``: the future of P's params."""
        future = self._futures.get(transfer_id)
        if future is None:
            future = self._futures[transfer_id] = asyncio.get_running_loop().create_future()
        return future

    def put(self, transfer_id: str, params: dict) -> None:
        """Called by a prefill leg with vLLM's answer."""
        future = self._futures.get(transfer_id)
        if future is None:
            future = self.wait(transfer_id)
            future.get_loop().call_later(HANDOFF_KEEP_S, self._expire, transfer_id, future)
        if not future.done():
            future.set_result(params)

    def drop(self, transfer_id: str) -> None:
        """Called when the decode leg's call ended (took the params or gave up)."""
        self._futures.pop(transfer_id, None)

    def _expire(self, transfer_id: str, future: asyncio.Future) -> None:
        if self._futures.get(transfer_id) is future:
            del self._futures[transfer_id]
            log.info("handoff %s: no decode leg took it", transfer_id)


class VllmBackend:
    """The vLLM engines of one Coordinator, sharing one ``Handoffs``: the registry's
    ``connect`` for a ``vllm://`` address (``runtime.vllm_server.parse_vllm_address``)."""

    def __init__(self) -> None:
        self.handoffs = Handoffs()

    def connect(self, address: str) -> VllmEngine:
        return VllmEngine(address, self.handoffs)


class VllmCall(EngineCall):
    """One leg on vLLM: a task runs its HTTP request and queues its messages, under
    the call's deadline (``asyncio.Timeout``, moved on by each message with ``idle_s``)."""

    def __init__(self, engine: VllmEngine, request: pb.GenerateRequest, timeout_s: float | None,
                 idle_s: float | None, end_s: float) -> None:
        self.request_id = request.request_id
        self.request = request
        self.loop = asyncio.get_running_loop()
        self._engine = engine
        self._items: deque[tuple[pb.GenerateResponse, float]] = deque()
        self._waiter: asyncio.Future | None = None
        self._end: BaseException | None = None
        self._idle_s = idle_s
        self._end_s = end_s
        self._timeout: asyncio.Timeout | None = None
        self.started_s = time.monotonic()
        first_s = math.inf if timeout_s is None else self.started_s + timeout_s
        self._first_due = min(first_s, end_s)
        kv = request.kv_transfer
        self.role = kv.role if request.HasField("kv_transfer") else "single"
        self.transfer_id = kv.transfer_id
        self.handoff = engine.handoffs.wait(kv.transfer_id) if self.role == "decode" else None
        self.task = self.loop.create_task(self._run())

    async def __anext__(self) -> pb.GenerateResponse:
        while not self._items:
            if self._end is not None:
                raise self._end
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        message, self.arrival_s = self._items.popleft()
        return message

    @property
    def headers(self) -> dict:
        return {"Content-Type": "application/json", "X-Request-Id": self.request_id}

    def cancel(self) -> bool:
        if self._end is not None:
            return False
        self._ended(CallCancelled("CANCELLED", "cancelled by the Coordinator"))
        self.task.cancel()  # closes the HTTP response: vLLM aborts the request
        return True

    # -- called by the engine's leg code, in the call's task --

    def put(self, message: pb.GenerateResponse) -> None:
        now = self.last_arrival_s = time.monotonic()
        self._items.append((message, now))
        if self._idle_s is not None and self._timeout is not None:
            due = min(now + self._idle_s, self._end_s)
            self._timeout.reschedule(self.loop.time() + due - now)
        self._wake()

    async def _run(self) -> None:
        delay = self._first_due - time.monotonic()
        try:
            async with asyncio.timeout_at(None if math.isinf(delay) else self.loop.time() + delay) as t:
                self._timeout = t
                await self._engine.run(self)
            end: BaseException = StopAsyncIteration()
        except asyncio.CancelledError:
            end = CallCancelled("CANCELLED", "the call's task was cancelled")
        except TimeoutError as exc:
            end = DeadlinePassed("DEADLINE_EXCEEDED", "Deadline Exceeded") if self._timeout.expired() \
                else EngineFailed("UNAVAILABLE", f"{type(exc).__name__}: {exc}")
        except EngineCallError as exc:
            end = exc
        except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: a malformed answer
            end = EngineFailed("UNAVAILABLE", f"{type(exc).__name__}: {exc}")
        self._ended(end)

    def _ended(self, end: BaseException) -> None:
        if self._end is None:
            self._end = end
            self._engine.forget(self)
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class VllmEngine(Engine):
    """One vLLM server (``address``: ``vllm://HOST:PORT[?...]``) as the Coordinator drives it."""

    def __init__(self, address: str, handoffs: Handoffs) -> None:
        http_address, identity = parse_vllm_address(address)
        self.address = address
        self.role = identity.role
        self.handoffs = handoffs
        self.url = f"http://{http_address}"
        self.server = VllmServer(http_address, identity, self._session)
        self._calls: dict[str, VllmCall] = {}
        self._http: aiohttp.ClientSession | None = None

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    @property
    def transport(self) -> str:
        return "http" if self._http is not None else ""

    def generate(self, request: pb.GenerateRequest, timeout_s: float | None = None,
                 idle_s: float | None = None, end_s: float = math.inf) -> VllmCall:
        call = VllmCall(self, request, timeout_s, idle_s, end_s)
        self._calls[request.request_id] = call
        return call

    def forget(self, call: VllmCall) -> None:
        if self._calls.get(call.request_id) is call:
            del self._calls[call.request_id]
        if call.handoff is not None:
            self.handoffs.drop(call.transfer_id)

    async def abort(self, request_id: str) -> bool:
        """vLLM has no abort call on its OpenAI server: closing the request's connection is it."""
        call = self._calls.get(request_id)
        return call is not None and call.cancel()

    async def close(self) -> None:
        calls = list(self._calls.values())
        for call in calls:
            call.cancel()
        await asyncio.gather(*(call.task for call in calls), return_exceptions=True)
        if self._http is not None:
            await self._http.close()
            self._http = None

    # -- a leg, run in its call's task --

    async def run(self, call: VllmCall) -> None:
        request = call.request
        body = completion_body(request)
        if call.role == "prefill":
            body.update(max_tokens=1, min_tokens=min(1, body["min_tokens"]), stream=False,
                        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
            answer = await self._whole(call, body)
            params = answer.get("kv_transfer_params")
            if not params:
                raise EngineFailed("FAILED_PRECONDITION", "the prefill engine returned no "
                                   "kv_transfer_params: is it started with a KV connector?")
            self.handoffs.put(call.transfer_id, params)
            first = answer_messages(request, answer, whole_timings(
                answer, time.monotonic() - call.started_s))[0]
            call.put(first)
            call.put(pb.GenerateResponse(request_id=request.request_id, finished=True,
                                         finish_reason="handoff", num_output_tokens=1,
                                         timings=pb.Timings()))
            return
        timings = pb.Timings()
        if call.role == "decode":
            body["kv_transfer_params"] = await call.handoff
            timings.kv_wait_s = time.monotonic() - call.started_s
        if request.sampling.prompt_logprobs:  # vLLM streams no prompt logprobs
            answer = await self._whole(call, {**body, "stream": False})
            timings.prefill_s = time.monotonic() - call.started_s
            for message in answer_messages(request, answer, timings):
                call.put(message)
            return
        await self._stream(call, body, timings)

    async def _whole(self, call: VllmCall, body: dict) -> dict:
        async with self._session().post(self.url + "/v1/completions", data=orjson.dumps(body),
                                        headers=call.headers) as response:
            payload = await response.read()
            if response.status != 200:
                raise http_error(call.role, response.status, payload)
        return orjson.loads(payload)

    async def _stream(self, call: VllmCall, body: dict, timings: pb.Timings) -> None:
        request = call.request
        sent_s = time.monotonic()
        num_output = 0
        async with self._session().post(self.url + "/v1/completions", data=orjson.dumps(body),
                                        headers=call.headers) as response:
            if response.status != 200:
                raise http_error(call.role, response.status, await response.read())
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    raise error_of(call.role, error.get("code", 500), error)
                for choice in chunk.get("choices", ()):
                    message = pb.GenerateResponse(request_id=request.request_id,
                                                  token_ids=choice.get("token_ids") or ())
                    num_output += len(message.token_ids)
                    if call.last_arrival_s == 0.0:
                        first_s = time.monotonic() - sent_s
                        if call.role == "decode":
                            timings.decode_queue_s = first_s
                        else:
                            timings.prefill_s = first_s
                        message.timings.CopyFrom(timings)
                        message.num_prompt_tokens = len(request.prompt_token_ids)
                    if choice.get("logprobs"):
                        scored = logprobs_of(message.token_ids, choice["logprobs"],
                                             request.sampling.top_logprobs)
                        if call.role == "decode" and num_output == len(scored):
                            del scored[:1]  # D's first token is P's: P's message scores it
                        message.logprobs.extend(scored)
                    if choice.get("finish_reason"):
                        message.finished = True
                        message.finish_reason = choice["finish_reason"]
                        message.num_output_tokens = num_output
                        message.timings.decode_s = time.monotonic() - sent_s - first_s
                    call.put(message)

    # -- health and load --

    async def health(self, timeout_s: float = 2.0) -> pb.HealthResponse:
        return await self._read(self.server.health, timeout_s)

    async def stats(self, timeout_s: float = 2.0) -> pb.StatsResponse:
        return await self._read(self.server.stats, timeout_s)

    @staticmethod
    async def _read(read, timeout_s: float):
        try:
            return await read(timeout_s)
        except VllmUnavailable as exc:
            if exc.is_timeout:
                raise DeadlinePassed("DEADLINE_EXCEEDED", str(exc)) from None
            raise EngineFailed("UNAVAILABLE", str(exc)) from None

    async def probe_peer(self, endpoint: str, test_transfer: bool = False,
                         timeout_s: float = 5.0) -> pb.ProbePeerResponse:
        """P's side channel accepting a connection (``VllmServer.probe_side_channel``);
        ``endpoint`` (D's) is not dialled: D dials P."""
        return await self.server.probe_side_channel(timeout_s)

    async def kv_events(self, epoch: str = "", since_seq: int = 0,
                        block_size: int = 0) -> AsyncIterator[pb.KVEventBatch]:
        """vLLM's prefix-cache events from its ZMQ publisher (the address's ``events``),
        as pdserve's hashes at ``block_size`` (``vllm_wire.BlockMap``). vLLM keeps no
        snapshot to resume from: each subscription starts one (the first batch), which
        knows the blocks stored from then on."""
        endpoint = self.server.identity.kv_events
        if not endpoint or not block_size:
            raise Unsupported("UNIMPLEMENTED", f"{self.address} publishes no KV events")
        sub = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(f"tcp://{endpoint}")
        blocks, snapshot = BlockMap(block_size), True
        try:
            while True:
                frames = await sub.recv_multipart()
                try:
                    seq = int.from_bytes(frames[-2], "big")
                    events = msgpack.unpackb(frames[-1])[1]
                    stored, removed, cleared = blocks.apply(events)
                except ValueError as exc:  # vLLM's blocks not made of ours: nothing to match
                    raise Unsupported("UNIMPLEMENTED", str(exc)) from None
                except (IndexError, KeyError, TypeError, msgpack.UnpackException) as exc:
                    raise EngineFailed("DATA_LOSS", f"a malformed KV event batch: {exc!r}") from None
                yield pb.KVEventBatch(epoch=self.address, seq=seq, snapshot=snapshot or cleared,
                                      stored=stored, removed=removed, block_size=block_size)
                snapshot = False
        finally:
            sub.close()

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(
                # One connection per running leg; idle ones dropped before vLLM's uvicorn
                # drops them (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): a request never goes out
                # on a connection the server is closing.
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEP_ALIVE_S),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
                read_bufsize=READ_BUFSIZE)
        return self._http
