"""The completion routes' hot path: POST /v1/completions and /v1/chat/completions
served without the web framework's layers.

FastAPI serves every other route, and declares these two for the OpenAPI document.
Through it a completion passed about ten ASGI levels on the way in (middlewares,
routing, dependency solving) and every one of them again on each ``send``: a fifth
of the Coordinator's CPU per request (docs/benchmarks.md, Coordinator overhead).
``CoordinatorApp`` hands these two POSTs to ``CompletionRoutes`` instead, which does
what those layers did, in the same order and with the same code:

  guard       auth, body size and body timeout (``guard.Guard``)
  decode      the body parsed as JSON by ``json.loads`` (as FastAPI does: a lone
              surrogate escape is left for the schema's check, which names the field)
              and validated by the route's pydantic model: failures are the app's
              400 (``errors.validation_error``)
  serve       ``serving.Completions.handle``
  errors      a ``ServeError`` is logged and counted once (``app.Rejections``) and
              answered as OpenAI's error JSON; any other exception is a bug: logged
              with its traceback, answered 500
  answer      JSON in one response (``serving.JSONAnswer``); a stream through
              ``write_stream``
  access log  one line per request (``runtime.logs.log_request``); a request the
              guard refused has its line from ``Rejections`` only, as before

A stream's events that are ready together go out in one ``send`` (one socket
write): when a session response brings several tokens of a request, or the
Coordinator is behind, the events queue and leave together; when the next token
is not there yet, what is ready is sent before waiting. A client that goes away
mid-stream cancels the stream (``serving.DisconnectWatch``), as in FastAPI's path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import StreamingResponse

from pdserve.runtime.logs import log_request

from .errors import ServeError, validation_error
from .guard import Guard, send_error
from .schemas import ChatCompletionRequest, CompletionRequest
from .serving import ClientGone, Completions, DisconnectWatch

log = logging.getLogger(__name__)
MODELS: dict[str, type[BaseModel]] = {"completions": CompletionRequest, "chat": ChatCompletionRequest}


def parse_body(body: bytes, model: type[BaseModel]) -> BaseModel:
    """The request as ``model``, or a 400 saying what is wrong with it."""
    try:
        data = json.loads(body)
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ServeError(400, f"the request body is not JSON: {exc}", code="invalid_request") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors(), 0) from None


class CompletionRoutes:
    """Built by ``create_app``; called by ``CoordinatorApp`` with the route's endpoint
    name (``completions`` or ``chat``)."""

    def __init__(self, completions: Completions, guard: Guard, rejections) -> None:
        self.completions = completions
        self.guard = guard
        self.rejections = rejections
        self.access_log = logging.getLogger("pdserve.access")

    async def __call__(self, scope, receive, send, endpoint: str) -> None:
        start = time.monotonic()
        loop = asyncio.get_running_loop()  # once: on Python 3.11 each look-up is a getpid
        guard = self.guard
        refusal = guard.authorize(scope)
        if refusal is not None:
            return await guard.refuse(scope, send, refusal)
        body = await guard.read_body(scope, receive, send, loop)
        if body is None:
            return
        try:
            request = parse_body(body, MODELS[endpoint])
            response = await self.completions.handle(Request(scope, receive), request, endpoint,
                                                     loop)
        except ServeError as err:
            return await self._refuse(scope, send, err, start)
        except Exception:
            log.exception("unhandled error on %s", scope["path"])  # a bug: its traceback is wanted
            return await self._refuse(scope, send, ServeError(500, "internal error",
                                                              code="internal_error"), start)
        status = response.status_code
        try:
            if isinstance(response, StreamingResponse):
                await send({"type": "http.response.start", "status": response.status_code,
                            "headers": response.raw_headers})
                try:
                    with DisconnectWatch(scope, receive, loop):
                        await write_stream(response.body_iterator, send)
                except ClientGone:
                    status = 499  # as the metrics count it: the client left mid-stream
            else:
                await response(scope, receive, send)
        finally:
            log_request(self.access_log, scope, status, response.label, start)

    async def _refuse(self, scope, send, err: ServeError, start: float) -> None:
        self.rejections.record(scope["method"], scope["path"], err)
        await send_error(send, err)
        log_request(self.access_log, scope, err.status, err.headers.get("x-request-id"), start)


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
