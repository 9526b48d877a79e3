"""The engine side of the Session RPC: many requests on one stream, each run by the
servicer's own Generate.

``SessionServicer`` is a mixin of an Engine servicer (the engine's ``EngineService``,
the tests' ``StubEngine``): its ``Session`` runs ``self.Generate(request, context)``
for every request the session carries, so a request's behaviour, errors and aborts
are Generate's, one piece of code. Each request gets a ``RequestContext`` whose
``abort`` ends that request alone with the status Generate would have ended its
call with (a ``RequestEnd`` on the stream); an exception out of Generate ends the
request with UNKNOWN, as gRPC ends a call, and is logged. A session request's cancel
cancels that request's Generate, as a cancelled call does (the engine aborts it).

Batching: the requests' messages and ends queue in the session's outbox; the
session's writer sends everything queued as one ``SessionResponse`` whenever it is
free, so the messages of one engine step (one per running request) share a write.

Invariants: a request id runs at most once at a time per session (a second is
refused with INVALID_ARGUMENT); every request started ends with exactly one
``RequestEnd`` unless it was cancelled or the session ended; the session ending
(the client gone: the call cancelled) cancels every request still running, so each
Generate's own clean-up frees its KV; the client closing its side lets running
requests finish, then the session ends.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.api.proto import engine_pb2 as pb

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

    def __init__(self, session: grpc.aio.ServicerContext) -> None:
        self._session = session

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise RequestAborted(code, details)

    def invocation_metadata(self):
        return self._session.invocation_metadata()

    def peer(self) -> str:
        return self._session.peer()


class SessionServicer:
    """Mixin: ``Session`` over the class's ``Generate`` (module docstring)."""

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        run = _SessionRun(self.Generate, context)
        async for response in run.responses(request_iterator):
            yield response


class _SessionRun:
    """One Session call: its running requests (tasks by request id) and its outbox."""

    def __init__(self, generate, context: grpc.aio.ServicerContext) -> None:
        self._generate = generate
        self._context = context
        self._tasks: dict[str, asyncio.Task] = {}
        self._messages: list[pb.GenerateResponse] = []
        self._ends: list[pb.RequestEnd] = []
        self._reading = True
        self._wake: asyncio.Future | None = None

    async def responses(self, request_iterator):
        """The session's responses until the client's side ended and no request runs;
        closed early (the call cancelled), it cancels every request still running."""
        reader = asyncio.ensure_future(self._read(request_iterator))
        try:
            while True:
                if self._messages or self._ends:
                    response = pb.SessionResponse(messages=self._messages, ends=self._ends)
                    self._messages, self._ends = [], []
                    yield response
                elif not self._reading and not self._tasks:
                    return
                else:
                    self._wake = asyncio.get_running_loop().create_future()
                    await self._wake
        finally:
            reader.cancel()
            for task in list(self._tasks.values()):
                task.cancel()

    async def _read(self, request_iterator) -> None:
        try:
            async for request in request_iterator:
                for generate in request.generate:
                    self._start(generate)
                for request_id in request.cancel:
                    task = self._tasks.get(request_id)
                    if task is not None:
                        task.cancel()
        except Exception as exc:  # the client's side broke: the call is ending
            log.debug("session read ended: %s", exc)
        finally:
            self._reading = False
            self._notify()

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
            async for message in self._generate(request, RequestContext(self._context)):
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

    def _notify(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)
