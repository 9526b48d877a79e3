"""The engine side of a session: many requests on one connection, each run by the
servicer's own Generate, served on the engine's session port.

``FrameSessionServer`` listens on the session port (``runtime/frames.py``:
length-prefixed frames on a plain or mTLS connection, the Coordinator's one wire
to an engine's requests) and runs ``servicer.Generate(request, context)`` for every
request a session carries (the engine's ``EngineService``, the tests'
``StubEngine``), so a request's behaviour, errors and aborts are Generate's, one
piece of code, whether it came as a gRPC call (the CLI, the doctor) or on a
session. Each request gets a ``RequestContext``
whose ``abort`` ends that request alone with the status Generate would have ended
its call with (a ``RequestEnd`` on the stream); an exception out of Generate ends
the request with UNKNOWN, as gRPC ends a call, and is logged. A session request's
cancel cancels that request's Generate, as a cancelled call does (the engine aborts it).

Batching: the requests' messages and ends queue in the session's outbox; the
session sends everything queued as one ``SessionResponse`` whenever it is free
(once per event-loop turn), so the messages of one
engine step (one per running request) share a write.

Invariants: a request id runs at most once at a time per session (a second is
refused with INVALID_ARGUMENT); every request started ends with exactly one
``RequestEnd`` unless it was cancelled or the session ended; the session ending
(the client gone, the connection lost) cancels every request
still running, so each Generate's own clean-up frees its KV; the client closing
its side lets running requests finish, then the session ends. On the session port
nothing is allocated for a peer before its hello passed (``frames``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from pdserve.api.proto import engine_pb2 as pb
from pdserve.runtime import frames
from pdserve.runtime.log_throttle import ThrottledLog
from pdserve.runtime.security import SecuritySettings

log = logging.getLogger(__name__)


class RequestAborted(Exception):
    """Raised by ``RequestContext.abort``: Generate ended its request with a status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class RequestContext:
    """What one session request's Generate sees as its ``context``: the session's
    metadata and peer, and an ``abort`` that ends this request only."""

    def __init__(self, metadata=(), peer: str = "") -> None:
        self._metadata = metadata
        self._peer = peer

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise RequestAborted(code, details)

    def invocation_metadata(self):
        return self._metadata

    def peer(self) -> str:
        return self._peer


class SessionRun:
    """One session: its running requests (tasks by request id) and its outbox.
    ``notify`` is called when the outbox has something or the session may be over."""

    def __init__(self, generate, context: RequestContext, notify: Callable[[], None]) -> None:
        self._generate = generate
        self._context = context
        self._notify = notify
        self._tasks: dict[str, asyncio.Task] = {}
        self._messages: list[pb.GenerateResponse] = []
        self._ends: list[pb.RequestEnd] = []
        self._reading = True

    @property
    def is_over(self) -> bool:
        """The client's side ended and no request runs or waits to be sent."""
        return not self._reading and not self._tasks and not self._messages and not self._ends

    def handle(self, request: pb.SessionRequest) -> None:
        """A session request from the client: its requests started, its cancels done."""
        for generate in request.generate:
            self._start(generate)
        for request_id in request.cancel:
            task = self._tasks.get(request_id)
            if task is not None:
                task.cancel()

    def end_of_requests(self) -> None:
        """The client closed its side: the session ends once its requests have."""
        self._reading = False
        self._notify()

    def take(self) -> pb.SessionResponse | None:
        """Everything queued as one response (None: nothing)."""
        if not self._messages and not self._ends:
            return None
        response = pb.SessionResponse(messages=self._messages, ends=self._ends)
        self._messages, self._ends = [], []
        return response

    def cancel_all(self) -> None:
        """The session ended: every request still running is cancelled."""
        for task in list(self._tasks.values()):
            task.cancel()

    def _start(self, request: pb.GenerateRequest) -> None:
        rid = request.request_id
        if not rid:
            self._end("", grpc.StatusCode.INVALID_ARGUMENT, "a session request needs a request_id")
        elif rid in self._tasks:
            self._end(rid, grpc.StatusCode.INVALID_ARGUMENT,
                      f"request id {rid!r} is already running in this session")
        else:
            task = self._tasks[rid] = asyncio.ensure_future(self._run(rid, request))
            task.add_done_callback(lambda _: self._done(rid, task))  # cancelled unstarted too

    async def _run(self, rid: str, request: pb.GenerateRequest) -> None:
        try:
            async for message in self._generate(request, self._context):
                if message.request_id != rid:
                    message.request_id = rid
                self._messages.append(message)
                self._notify()
            self._end(rid, grpc.StatusCode.OK, "")
        except RequestAborted as exc:
            self._end(rid, exc.code, exc.details)
        except Exception as exc:
            log.exception("request %s failed in its session", rid)
            self._end(rid, grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}")

    def _done(self, rid: str, task: asyncio.Task) -> None:
        if self._tasks.get(rid) is task:
            del self._tasks[rid]
        self._notify()

    def _end(self, rid: str, code: grpc.StatusCode, details: str) -> None:
        self._ends.append(pb.RequestEnd(request_id=rid, code=code.value[0], details=details))
        self._notify()


class FrameSessionServer:
    """The session port: a listener whose connections each carry one session of
    ``servicer`` (its Generate), after the peer's hello (``runtime/frames.py``)."""

    def __init__(self, servicer, security: SecuritySettings | None = None) -> None:
        self._servicer = servicer
        self._security = security or SecuritySettings()
        self._refusals = ThrottledLog(log)
        self._server: asyncio.Server | None = None
        self._connections: set[_FrameSession] = set()
        self.port = 0

    async def start(self, host: str, port: int = 0) -> int:
        """Listens on ``host:port`` (0: a free port); returns the bound port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _FrameSession(self), host, port,
            ssl=frames.ssl_context(self._security, server=True))
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self, grace_s: float = 1.0) -> None:
        """Stops listening and ends every session (their requests are cancelled): what
        is written goes out within ``grace_s``, then the connections are cut."""
        if self._server is None:
            return
        self._server.close()
        connections = list(self._connections)
        for connection in connections:
            connection.close()
        if connections:
            lost = [c.lost for c in connections]
            _, pending = await asyncio.wait(lost, timeout=grace_s)
            for connection in connections:
                if connection.lost in pending:
                    connection.abort()
            await asyncio.wait(lost)
        await self._server.wait_closed()

    def refused(self, peer: str, reason: str) -> None:
        self._refusals.log(logging.WARNING, ("session", reason),
                           "refused a session from %s: %s", peer, reason)


class _FrameSession(asyncio.Protocol):
    """One connection of the session port: the hello, then a ``SessionRun``."""

    def __init__(self, server: FrameSessionServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._reader = frames.FrameReader(frames.MAX_HELLO_BYTES)
        self._run: SessionRun | None = None  # after the hello
        self._hello_timer: asyncio.TimerHandle | None = None
        self._flush_scheduled = False
        self._can_write = True
        self._peer = ""
        self._loop = asyncio.get_running_loop()
        self.lost = self._loop.create_future()  # done when the connection is

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if peer else ""
        self._hello_timer = self._loop.call_later(
            frames.HELLO_TIMEOUT_S, self._refuse, "no hello in time")

    def data_received(self, data: bytes) -> None:
        try:
            received = self._reader.feed(data)
        except frames.FrameError as exc:
            return self._refuse(str(exc)) if self._run is None else self._broken(str(exc))
        for payload in received:
            if self._run is None:
                self._hello(payload)
                if self._run is None:
                    return
                continue
            try:
                request = pb.SessionRequest.FromString(payload)
            except Exception as exc:  # protobuf's DecodeError: a malformed peer
                return self._broken(f"a frame that is not a SessionRequest: {exc}")
            self._run.handle(request)

    def eof_received(self) -> bool:
        if self._run is None:
            self._transport.close()
            return False
        self._run.end_of_requests()
        return True  # the answers of the requests running still go out

    def connection_lost(self, exc: Exception | None) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        self._server._connections.discard(self)
        if self._run is not None:
            self._run.cancel_all()
        if not self.lost.done():
            self.lost.set_result(None)

    def pause_writing(self) -> None:
        self._can_write = False

    def resume_writing(self) -> None:
        self._can_write = True
        self._notify()

    def close(self) -> None:
        self._transport.close()

    def abort(self) -> None:
        self._transport.abort()

    def _hello(self, payload: bytes) -> None:
        reason = frames.check_hello(payload, self._server._security.token)
        if reason is not None:
            return self._refuse(reason)
        self._hello_timer.cancel()
        self._hello_timer = None
        self._reader.max_bytes = frames.MAX_FRAME_BYTES
        self._run = SessionRun(self._server._servicer.Generate,
                               RequestContext((), f"ipv4:{self._peer}"), self._notify)
        self._server._connections.add(self)
        self._transport.write(frames.frame(frames.OK))

    def _refuse(self, reason: str) -> None:
        self._server.refused(self._peer, reason)
        if not self._transport.is_closing():
            self._transport.write(frames.frame(frames.REFUSED + reason.encode()))
            self._transport.close()

    def _broken(self, reason: str) -> None:
        log.warning("session from %s ended: %s", self._peer, reason)
        self._transport.abort()

    def _notify(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        run, transport = self._run, self._transport
        if run is None or transport.is_closing() or not self._can_write:
            return
        response = run.take()
        if response is not None:
            transport.write(frames.frame(response.SerializeToString()))
        if run.is_over:
            transport.close()
