"""The embedded engine behind the engine interface: its requests on one session.

``EmbeddedEngine`` (one per engine address, held by ``InstanceRegistry.engine``)
is ``engines.Engine`` for pdserve's own engine (and anything serving its API). Its
requests ride one session: on first use it asks the engine's Health for its
session port and opens a connection there (``runtime/frames.py``: length-prefixed
frames after a hello carrying the cluster token), and keeps it. The legs' requests
and cancels queued in one event-loop turn leave as one ``SessionRequest``, and each
``SessionResponse``'s messages and ends go to the ``SessionCall`` of their request id.
A ``SessionCall`` (``engines.EngineCall``) is an async iterator of the request's
``GenerateResponse`` messages that ends as the request does (its end raised as one
of pdserve's own ``engine_errors``), plus ``cancel``. Abort, Health, Stats,
ProbePeer and KVEvents are the engine's gRPC calls, their errors turned into
``engine_errors`` here too: nothing above this module sees gRPC's types.

Deadlines are the Coordinator's: each call has a timer at its deadline that fails it
with DEADLINE_EXCEEDED and cancels the request on the engine (``DeadlinePassed``).
A call that streams tokens has an idle bound too: each message moves
its deadline to the message's arrival plus ``idle_s``. Nothing is re-armed per
message: the session stamps each message's arrival (one clock read per session
response), and the timer, when it fires, looks at the stamp and is armed again
for the rest of the gap while messages keep coming (``deadlines.py``).

Invariants: a call ends once (its end, its deadline, its cancel, or the session
breaking), and then leaves the session's table; a link that breaks (the engine
gone, refused, no session port, the connection lost, a malformed frame) fails every
call on it (``EngineFailed``), and the next ``generate`` opens a new one; an open link
that breaks calls ``on_lost`` (the registry stops routing to the engine at once, not
after the Controller's view says it died); ``close`` (the app's shutdown) ends the link
and its tasks.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import grpc

from pdserve.api.proto import engine_pb2 as pb
from pdserve.runtime import frames
from pdserve.runtime.engine_client import EngineClient

from .engine_errors import (
    CallCancelled,
    DeadlinePassed,
    EngineCallError,
    EngineFailed,
    from_rpc_error,
    from_status,
)
from .engines import Engine, EngineCall

log = logging.getLogger(__name__)
OPEN_TIMEOUT_S = 5.0  # the engine's Health answer, then the session port's hello


class SessionCall(EngineCall):
    """One request on a session: iterate its messages; ``cancel`` when giving up.

    With ``holds`` set, the reader is woken for the first message and then only for
    the last (a finished one, or the call's end): the messages between wait in the
    call and are read in one go, not one wake each."""

    def __init__(self, session: EmbeddedEngine, request_id: str) -> None:
        self.request_id = request_id
        self._session = session
        self.loop = session.loop  # the event loop's, held (each look-up costs a getpid)
        self._items: deque[pb.GenerateResponse] = deque()
        self._waiter: asyncio.Future | None = None
        self._end: BaseException | None = None  # StopAsyncIteration or the error
        self._timer: asyncio.TimerHandle | None = None
        self._first_s = math.inf  # the deadline until the first message (monotonic)
        self._idle_s: float | None = None  # then each message's arrival plus this
        self._end_s = math.inf  # and never later than this
        self.holds = False
        self._num_put = 0
        self._arrivals: deque[float] = deque()  # of the messages in ``_items``, when holding
        self.arrival_s = 0.0
        self.last_arrival_s = 0.0

    async def __anext__(self) -> pb.GenerateResponse:
        while not self._items:
            if self._end is not None:
                raise self._end
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.holds:
            self.arrival_s = self._arrivals.popleft()
        return self._items.popleft()

    def cancel(self) -> bool:
        if self._end is not None:
            return False
        self._session.cancel(self.request_id)
        self.ended(CallCancelled("CANCELLED", "cancelled by the Coordinator"))
        return True

    # -- called by the session --

    def put(self, message: pb.GenerateResponse, now: float) -> None:
        """``message`` arrived at ``now`` (``time.monotonic``)."""
        self._items.append(message)
        self.last_arrival_s = now
        if not self.holds:
            self._wake()
            return
        self._arrivals.append(now)
        self._num_put += 1
        if self._num_put == 1 or message.finished:
            self._wake()

    def ended(self, end: BaseException) -> None:
        """The call is over (``end`` is raised once the messages before it are read)."""
        if self._end is None:
            self._end = end
            self._session.forget(self.request_id)
            if self._timer is not None:
                self._timer.cancel()
            self._wake()

    def arm(self, timeout_s: float, idle_s: float | None, end_s: float) -> None:
        """Called by ``EmbeddedEngine.generate``: the first message is due within
        ``timeout_s``; with ``idle_s``, each later one within ``idle_s`` of the one
        before, never after ``end_s``; without, ``timeout_s`` bounds the whole call."""
        self._first_s = time.monotonic() + timeout_s
        self._idle_s, self._end_s = idle_s, end_s
        # Before the first message the timer also wakes every ``idle_s``: a first
        # message long before the first deadline starts the idle bound in time.
        first_wait = timeout_s if idle_s is None else min(timeout_s, idle_s)
        self._timer = self.loop.call_later(first_wait, self._on_timer)

    def _on_timer(self) -> None:
        """The timer: expires the call when its deadline passed, else waits on for the
        rest (messages came since it was armed and moved the deadline)."""
        if self._end is not None:
            return
        now = time.monotonic()
        if self._idle_s is None or not self.last_arrival_s:
            due = self._first_s
            wait = due - now if self._idle_s is None else min(due - now, self._idle_s)
        else:
            due = min(self.last_arrival_s + self._idle_s, self._end_s)
            wait = due - now
        if due <= now:
            self.expire()
        else:
            self._timer = self.loop.call_later(wait, self._on_timer)

    def expire(self) -> None:
        """The deadline passed: the engine is told to cancel; reading raises ``DeadlinePassed``."""
        if self._end is None:
            self._session.cancel(self.request_id)
            self.ended(DeadlinePassed("DEADLINE_EXCEEDED", "Deadline Exceeded"))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class EmbeddedEngine(Engine):
    """pdserve's engine at one address: its session, shared by every leg sent to it,
    and its gRPC client for the rest."""

    def __init__(self, client: EngineClient, on_lost: Callable[[], None] | None = None) -> None:
        """``on_lost``: called when an open session's connection ends other than by
        ``close`` (the engine died, restarted or dropped it)."""
        self.address = client.address
        self._client = client
        self._on_lost = on_lost
        self._calls: dict[str, SessionCall] = {}
        self._link: _Link | None = None
        self._generate: list[pb.GenerateRequest] = []
        self._cancel: list[str] = []
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop it was opened on

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    @property
    def transport(self) -> str:
        """"frames" once the session is open, "" before."""
        return "frames" if self._link is not None and self._link.is_open else ""

    def generate(self, request: pb.GenerateRequest, timeout_s: float | None = None,
                 idle_s: float | None = None, end_s: float = math.inf) -> SessionCall:
        """Sends ``request`` on the session (opened if it is not)."""
        link = self._link
        if link is None:
            self.loop = asyncio.get_running_loop()
            link = self._link = _Link(self)
        call = SessionCall(self, request.request_id)
        self._calls[request.request_id] = call
        if timeout_s is not None:
            call.arm(timeout_s, idle_s, end_s)
        self._generate.append(request)
        link.wake()
        return call

    def cancel(self, request_id: str) -> None:
        """Called by a ``SessionCall`` given up on (cancelled, past its deadline)."""
        if self._link is not None:
            self._cancel.append(request_id)
            self._link.wake()

    def forget(self, request_id: str) -> None:
        self._calls.pop(request_id, None)

    async def close(self) -> None:
        link = self._link
        if link is not None:
            self.broken(link, CallCancelled("CANCELLED", "the Coordinator is closing"))
            await link.closed()
        await self._client.close()

    # -- the engine's other calls: gRPC, their errors as ``engine_errors`` --

    async def abort(self, request_id: str) -> bool:
        return await _rpc(self._client.abort(request_id))

    async def health(self, timeout_s: float = 2.0) -> pb.HealthResponse:
        return await _rpc(self._client.health(timeout_s))

    async def stats(self, timeout_s: float = 2.0) -> pb.StatsResponse:
        return await _rpc(self._client.stats(timeout_s))

    async def probe_peer(self, endpoint: str, test_transfer: bool = False,
                         timeout_s: float = 5.0) -> pb.ProbePeerResponse:
        return await _rpc(self._client.probe_peer(endpoint, test_transfer, timeout_s))

    async def kv_events(self, epoch: str = "", since_seq: int = 0,
                        block_size: int = 0) -> AsyncIterator[pb.KVEventBatch]:
        try:
            async for batch in self._client.kv_events(epoch, since_seq):
                yield batch
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    # -- called by the link --

    def take_outgoing(self) -> pb.SessionRequest | None:
        """Everything queued to send, as one request (None: nothing)."""
        if not self._generate and not self._cancel:
            return None
        request = pb.SessionRequest(generate=self._generate, cancel=self._cancel)
        self._generate, self._cancel = [], []
        return request

    def deliver(self, response: pb.SessionResponse) -> None:
        """The engine's messages and ends, each to its call."""
        calls = self._calls
        now = time.monotonic()  # one read for the response's messages
        for message in response.messages:
            target = calls.get(message.request_id)
            if target is not None:
                target.put(message, now)
        for end in response.ends:
            target = calls.get(end.request_id)
            if target is None:
                if end.code:
                    log.info("session %s: request %r ended: %s", self.address,
                             end.request_id, end.details)
                continue
            target.ended(from_status(end.code, end.details) if end.code else StopAsyncIteration())

    def broken(self, link: _Link, exc: BaseException) -> None:
        """Fails every call of ``link`` with what ``exc`` says (an ``EngineCallError``,
        else ``EngineFailed`` saying what happened); the next generate opens a new
        link. First one wins."""
        if self._link is not link:
            return
        log.info("session to engine %s broke: %s", self.address, _describe(exc))
        self._link = None
        if link.is_open and not isinstance(exc, CallCancelled) and self._on_lost is not None:
            self._on_lost()
        self._generate, self._cancel = [], []
        calls, self._calls = self._calls, {}
        if not isinstance(exc, EngineCallError):
            exc = EngineFailed("UNAVAILABLE", _describe(exc))
        kind, status, details = type(exc), exc.status, exc.details
        for target in calls.values():  # an error each: one raised many times grows its traceback
            target.ended(kind(status, details))
        link.shut()


class _Link:
    """One opened session to the engine: asks its Health for the session port, then
    runs frames on it (``_FrameProtocol``). Requests queued before it is up leave
    once it is."""

    def __init__(self, session: EmbeddedEngine) -> None:
        self._session = session
        self._loop = session.loop
        self.is_open = False
        self._frames: _FrameProtocol | None = None
        self._flush_scheduled = False
        self._task = self._loop.create_task(self._run())

    def wake(self) -> None:
        """Something is queued to send: it leaves at the end of this loop turn."""
        if self.is_open and not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def shut(self) -> None:
        """Called by ``EmbeddedEngine.broken``: the connection is ended."""
        if self._frames is not None:
            self._frames.close()
        if self._task is not asyncio.current_task(self._loop):
            self._task.cancel()

    async def closed(self) -> None:
        await asyncio.gather(self._task, return_exceptions=True)

    def _flush(self) -> None:
        self._flush_scheduled = False
        request = self._session.take_outgoing()
        if request is not None:
            self._frames.write(frames.frame(request.SerializeToString()))

    async def _run(self) -> None:
        session = self._session
        try:
            try:
                health = await session._client.health(timeout_s=OPEN_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                raise EngineFailed("UNAVAILABLE", f"cannot open a session: {_describe(exc)}") from None
            if not health.session_port:
                raise EngineFailed("UNAVAILABLE", "the engine names no session port")
            try:
                protocol = await self._connect(health.session_port)
            except (OSError, TimeoutError) as exc:  # e.g. a firewall between them
                raise EngineFailed("UNAVAILABLE", f"session port {health.session_port} "
                                   f"unreachable: {_describe(exc)}") from None
            self._frames, self.is_open = protocol, True
            self._flush()
            await protocol.lost
            raise EngineFailed("UNAVAILABLE", "the engine ended the session")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            session.broken(self, exc)

    async def _connect(self, port: int) -> _FrameProtocol:
        """A frame connection to the session port that passed the hello."""
        session = self._session
        host = frames.split_address(session.address)
        security = session._client.security
        context = frames.ssl_context(security, server=False)
        _, protocol = await asyncio.wait_for(self._loop.create_connection(
            lambda: _FrameProtocol(session, self._loop), host, port, ssl=context,
            server_hostname=host if context is not None else None), OPEN_TIMEOUT_S)
        protocol.write(frames.hello(security.token))
        try:
            await asyncio.wait_for(asyncio.shield(protocol.answered), OPEN_TIMEOUT_S)
        except BaseException:
            protocol.close()
            raise
        return protocol


class _FrameProtocol(asyncio.Protocol):
    """The Coordinator's end of a session port connection: the hello's answer, then
    ``SessionResponse`` frames handed to the session."""

    def __init__(self, session: EmbeddedEngine, loop: asyncio.AbstractEventLoop) -> None:
        self._session = session
        self._reader = frames.FrameReader()
        self._transport: asyncio.Transport | None = None
        self.answered = loop.create_future()  # the hello's answer: OK, or the refusal
        self.lost = loop.create_future()  # the connection's end: its error, or None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            received = self._reader.feed(data)
            for payload in received:
                if self.lost.done():
                    return
                if not self.answered.done():
                    self._answer(payload)
                else:
                    self._session.deliver(pb.SessionResponse.FromString(payload))
        except Exception as exc:  # a frame too long, not a SessionResponse: a broken peer
            self._end(EngineFailed("UNAVAILABLE", f"malformed session frame: {exc}"))
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(EngineFailed("UNAVAILABLE", f"the session connection was lost: {exc}" if exc
                               else "the engine ended the session"))

    def write(self, data: bytes) -> None:
        self._transport.write(data)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _answer(self, payload: bytes) -> None:
        if payload == frames.OK:
            self.answered.set_result(None)
            return
        reason = payload.removeprefix(frames.REFUSED).decode(errors="replace")
        self._end(EngineFailed("UNAVAILABLE", f"the engine refused the session: {reason}"))
        self._transport.close()

    def _end(self, error: EngineFailed) -> None:
        for future in (self.answered, self.lost):
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: the link reads whichever it awaits


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, EngineCallError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


async def _rpc(call):
    """The answer of one of the engine's gRPC calls, its error as an ``engine_errors`` one."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc) from None
