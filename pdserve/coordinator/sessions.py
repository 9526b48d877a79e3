"""The Coordinator's one stream per engine: every leg on that engine rides its Session.

``EngineSession`` (one per engine address, held by ``InstanceRegistry.session``)
opens the engine's Session RPC on first use and keeps it: a writer task sends the
legs' requests and cancels (everything queued at once in one ``SessionRequest``), a
reader task hands each ``SessionResponse``'s messages and ends to the ``SessionCall``
of their request id. A ``SessionCall`` is what a Generate call was to a leg: an
async iterator of the request's ``GenerateResponse`` messages that ends as the call
would (the end's status raised as ``grpc.aio.AioRpcError``, so ``legs.Leg``
classifies one kind of error), plus ``cancel``.

Deadlines are the Coordinator's: each call has a timer at its deadline that fails it
with DEADLINE_EXCEEDED and cancels the request on the engine, as a call's gRPC
deadline did.

Invariants: a call ends once (its end, its deadline, its cancel, or the session
breaking), and then leaves the session's table; a session that breaks (the engine
gone, the stream failed or ended) fails every call on it with that error and is
opened afresh by the next ``generate``; ``close`` (the app's shutdown) cancels the
stream and its tasks.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import grpc

from pdserve.api.proto import engine_pb2 as pb
from pdserve.runtime.engine_client import EngineClient

log = logging.getLogger(__name__)
_NO_METADATA = grpc.aio.Metadata()


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, _NO_METADATA, _NO_METADATA, details)


class SessionCall:
    """One request on a session: iterate its messages; ``cancel`` when giving up."""

    def __init__(self, session: EngineSession, request_id: str) -> None:
        self.request_id = request_id
        self._session = session
        self.loop = session.loop  # the event loop's, held (each look-up costs a getpid)
        self._items: deque[pb.GenerateResponse] = deque()
        self._waiter: asyncio.Future | None = None
        self._end: BaseException | None = None  # StopAsyncIteration or the error
        self._timer: asyncio.TimerHandle | None = None

    def __aiter__(self) -> SessionCall:
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        while not self._items:
            if self._end is not None:
                raise self._end
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def cancel(self) -> bool:
        """Called by ``Leg.close`` for a leg that did not finish: the engine is told to
        cancel the request; reading on raises CANCELLED. False if it had ended."""
        if self._end is not None:
            return False
        self._session.cancel(self.request_id)
        self.ended(rpc_error(grpc.StatusCode.CANCELLED, "cancelled by the Coordinator"))
        return True

    # -- called by the session --

    def put(self, message: pb.GenerateResponse) -> None:
        self._items.append(message)
        self._wake()

    def ended(self, end: BaseException) -> None:
        """The call is over (``end`` is raised once the messages before it are read)."""
        if self._end is None:
            self._end = end
            self._session.forget(self.request_id)
            if self._timer is not None:
                self._timer.cancel()
            self._wake()

    def expire(self) -> None:
        """The deadline's timer."""
        if self._end is None:
            self._session.cancel(self.request_id)
            self.ended(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class EngineSession:
    """The Session stream to one engine, shared by every leg sent to it."""

    def __init__(self, client: EngineClient) -> None:
        self.address = client.address
        self._client = client
        self._calls: dict[str, SessionCall] = {}
        self._call: grpc.aio.StreamStreamCall | None = None
        self._tasks: tuple[asyncio.Task, ...] = ()
        self._generate: list[pb.GenerateRequest] = []
        self._cancel: list[str] = []
        self._has_outgoing: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop it was opened on

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def generate(self, request: pb.GenerateRequest, timeout_s: float | None = None) -> SessionCall:
        """Called by ``Leg.start``: sends ``request`` on the session (opened if it is
        not), failing it with DEADLINE_EXCEEDED after ``timeout_s``."""
        if self._call is None:
            self._open()
        call = SessionCall(self, request.request_id)
        self._calls[request.request_id] = call
        if timeout_s is not None:
            call._timer = self.loop.call_later(timeout_s, call.expire)
        self._generate.append(request)
        self._has_outgoing.set()
        return call

    def cancel(self, request_id: str) -> None:
        """Called by a ``SessionCall`` given up on (cancelled, past its deadline)."""
        if self._call is not None:
            self._cancel.append(request_id)
            self._has_outgoing.set()

    def forget(self, request_id: str) -> None:
        self._calls.pop(request_id, None)

    def _open(self) -> None:
        call = self._call = self._client.session()
        self.loop = asyncio.get_running_loop()
        self._has_outgoing = asyncio.Event()
        self._tasks = (self.loop.create_task(self._write(call)),
                       self.loop.create_task(self._read(call)))

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        has_outgoing = self._has_outgoing
        try:
            while True:
                await has_outgoing.wait()
                has_outgoing.clear()
                request = pb.SessionRequest(generate=self._generate, cancel=self._cancel)
                self._generate, self._cancel = [], []
                await call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            self._broken(call, exc)  # the reader sees the call's status too; first one wins

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        calls = self._calls
        try:
            async for response in call:
                for message in response.messages:
                    target = calls.get(message.request_id)
                    if target is not None:
                        target.put(message)
                for end in response.ends:
                    target = calls.get(end.request_id)
                    if target is None:
                        if end.code:
                            log.info("session %s: request %r ended: %s", self.address,
                                     end.request_id, end.details)
                        continue
                    target.ended(rpc_error(_STATUS.get(end.code, grpc.StatusCode.UNKNOWN),
                                           end.details) if end.code else StopAsyncIteration())
            self._broken(call, rpc_error(grpc.StatusCode.UNAVAILABLE, "the engine ended the session"))
        except grpc.aio.AioRpcError as exc:
            self._broken(call, exc)

    def _broken(self, call: grpc.aio.StreamStreamCall, exc: Exception) -> None:
        """Fails every call of ``call``'s session with ``exc``; the next generate reopens."""
        if self._call is not call:
            return
        log.info("session to engine %s broke: %s", self.address, _describe(exc))
        self._call = None
        self._generate, self._cancel = [], []
        calls, self._calls = self._calls, {}
        code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.UNAVAILABLE
        details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else _describe(exc)
        for target in calls.values():  # an error each: one raised many times grows its traceback
            target.ended(rpc_error(code, details))
        call.cancel()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def close(self) -> None:
        """Called by ``InstanceRegistry.close`` at the app's shutdown."""
        call, tasks = self._call, self._tasks
        if call is not None:
            self._broken(call, rpc_error(grpc.StatusCode.CANCELLED, "the Coordinator is closing"))
        await asyncio.gather(*tasks, return_exceptions=True)


_STATUS = {code.value[0]: code for code in grpc.StatusCode}


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
