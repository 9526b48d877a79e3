"""The Coordinator's HTTP server, and the few places where its HTTP path departs from
what uvicorn and Starlette would do by themselves: each measured, each kept because it
paid (the figures: docs/benchmarks.md, Coordinator overhead, "Changes measured").

The server is uvicorn (httptools) with the limits a public endpoint needs. uvicorn
closes an idle keep-alive connection ``timeout_keep_alive`` after its last response,
but arms that timer only after a response and disarms it at the first byte: a
connection that never sends a request, or stops halfway through its headers, stays
open for good. ``build_config`` adds what is missing:

  keep-alive      an idle connection closes ``http_keep_alive_s`` after its last response
  header timeout  a request's headers must be complete ``http_header_timeout_s`` after
                  the connection opened or its previous response ended; else the
                  connection closes (with 408 if a request had begun)
  header size     at most ``MAX_HEADER_BYTES`` of request line and headers (431)
  connections     past ``max_connections`` open connections (or requests in flight),
                  uvicorn answers 503
  body timeout    the guard's (``guard.py``), which reads the body: 408

The departures, all on the completion routes' path (``front.py``):

  _LimitedHttpToolsProtocol  uvicorn's httptools protocol, subclassed: the header
                  timeout and size above, which uvicorn has no setting for, and a
                  ``ClientHook`` in each request's scope (``CLIENT_HOOK``) that the
                  connection's loss fires, so that ``serving.DisconnectWatch`` learns
                  that a client went away without a task per request waiting on
                  ``receive`` (that task, its waits and its cancellation were the cost)
  write_stream    a stream's events that are ready together go out in one ``send``
                  (one socket write), where Starlette's ``StreamingResponse`` sends
                  each event alone: the stubs' and a busy Coordinator's tokens come
                  several at once, and a socket write per event was most of
                  uvicorn's share of a stream
  JSONAnswer      a completion's JSON answer as Starlette's ``Response`` with its three
                  headers written out, not built by ``Response.__init__`` (which
                  lowercases, copies and encodes each)

Called by ``pdserve coordinator`` (``cli.run``) and by the tests' server harness, so
both serve with the same limits. The protocol runs on the event loop; its timers
are the loop's. ``Server.run`` (the CLI) runs it on uvloop, which costs the
Coordinator less CPU per request than asyncio's own loop; the harness serves on its
own asyncio loop.
"""

from __future__ import annotations

import asyncio

import uvicorn
from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .settings import CoordinatorSettings

MAX_HEADER_BYTES = 64 * 1024
CLIENT_HOOK = "pdserve.client_hook"


class ClientHook:
    """In each request's scope (``CLIENT_HOOK``): ``is_gone`` once the connection was
    lost before the response completed, and then ``callback`` (if set) is called once."""

    __slots__ = ("is_gone", "callback")

    def __init__(self) -> None:
        self.is_gone = False
        self.callback = None

    def fire(self) -> None:
        self.is_gone = True
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


class _LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus the header timeout and size limit. One per
    connection; ``header_timeout_s`` is set on the subclass ``build_config`` makes."""

    header_timeout_s = 5.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._is_reading_headers = True  # between two requests, or before the first
        self._num_header_bytes = 0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:  # the response had not completed
            hook = cycle.scope.get(CLIENT_HOOK)
            if hook is not None:
                hook.fire()

    def data_received(self, data: bytes) -> None:
        if self._is_reading_headers:
            self._num_header_bytes += len(data)
        super().data_received(data)
        if self._is_reading_headers and self._num_header_bytes > MAX_HEADER_BYTES:
            self._refuse(b"431 Request Header Fields Too Large",
                         f"request headers larger than {MAX_HEADER_BYTES} bytes")

    def on_headers_complete(self) -> None:
        self._is_reading_headers = False
        self._num_header_bytes = 0
        self._disarm_header_timer()
        self.scope[CLIENT_HOOK] = ClientHook()  # the scope the request's cycle gets
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._is_reading_headers = True  # the next bytes are the next request's
        super().on_message_complete()

    def on_response_complete(self) -> None:
        is_pipelined = bool(self.pipeline)  # the next request's headers are in already
        super().on_response_complete()
        if not is_pipelined and not self.transport.is_closing():
            self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._num_header_bytes:
            self._refuse(b"408 Request Timeout",
                         f"request headers not complete within {self.header_timeout_s:g}s")
        else:
            self.transport.close()  # idle: nothing to answer

    def _refuse(self, status: bytes, message: str) -> None:
        body = message.encode()
        self.transport.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8"
                             b"\r\nconnection: close\r\ncontent-length: " + str(len(body)).encode()
                             + b"\r\n\r\n" + body)
        self.transport.close()


def build_config(app, settings: CoordinatorSettings, log_level: str = "info") -> uvicorn.Config:
    """The uvicorn config serving ``app`` with ``settings``' HTTP limits."""
    protocol = type("CoordinatorHttpProtocol", (_LimitedHttpToolsProtocol,),
                    {"header_timeout_s": settings.http_header_timeout_s})
    # proxy_headers off: nothing of the Coordinator reads the client's address or
    # scheme, which is all uvicorn's X-Forwarded-* middleware would rewrite, per request.
    return uvicorn.Config(app, log_level=log_level, access_log=False, loop="uvloop",
                          http=protocol, lifespan="on", proxy_headers=False,
                          timeout_keep_alive=settings.http_keep_alive_s,
                          limit_concurrency=settings.max_connections)


class JSONAnswer(Response):
    """A completion's JSON answer (``serving.Completions.handle``): Starlette's
    ``Response`` with its three headers written out at once; ``label`` is its
    ``x-request-id``."""

    media_type = "application/json"

    def __init__(self, body: bytes, label: str) -> None:
        self.status_code = 200
        self.body = body
        self.background = None
        self.label = label
        self.raw_headers = [(b"x-request-id", label.encode()),
                            (b"content-length", b"%d" % len(body)),
                            (b"content-type", b"application/json")]


async def write_stream(events, send) -> None:
    """Sends the async iterator ``events`` (bytes) as the rest of a response body, the
    ones ready at once in one ``send``; closes ``events`` if it ends early.

    Each step of ``events`` is run by hand (``send(None)`` on ``__anext__()``): a step
    that finishes without waiting adds to what is ready; one that must wait has what
    is ready sent first and is then awaited (``_Rest``) as ``await`` would have."""
    ready: list[bytes] = []
    try:
        while True:
            step = events.__anext__()
            try:
                waits_on = step.send(None)
            except StopIteration as got:
                ready.append(got.value)
                continue
            except StopAsyncIteration:
                break
            if ready:
                chunk = b"".join(ready)
                ready.clear()
                try:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except BaseException as exc:
                    # The step waits inside ``events``: it gets the error there (its
                    # clean-up runs), then the error goes on.
                    await _Rest(step, None, exc)
                    raise
            try:
                ready.append(await _Rest(step, waits_on))
            except StopAsyncIteration:
                break
    except BaseException:
        await events.aclose()
        raise
    await send({"type": "http.response.body", "body": b"".join(ready), "more_body": False})


class _Rest:
    """The rest of a coroutine step that already ran up to its first wait, which
    yielded ``waits_on`` (what the task must wait for): awaiting it passes that and
    everything after it to the task, and the task's answers (a value, a cancellation)
    back into the step, until the step returns or raises. With ``throw`` the step
    first gets that exception where it waits."""

    __slots__ = ("step", "waits_on", "throw")

    def __init__(self, step, waits_on, throw: BaseException | None = None) -> None:
        self.step, self.waits_on, self.throw = step, waits_on, throw

    def __await__(self):
        step = self.step
        try:
            signal = self.waits_on if self.throw is None else step.throw(self.throw)
            while True:
                try:
                    sent = yield signal
                except BaseException as exc:  # e.g. the task was cancelled while waiting
                    signal = step.throw(exc)
                else:
                    signal = step.send(sent)
        except StopIteration as done:
            return done.value
