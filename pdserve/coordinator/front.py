"""``CoordinatorApp``: the Coordinator's ASGI app, and the one path every HTTP request takes.

Every request, whatever its route, passes these steps, here and nowhere else:

  guard       auth, body size and body timeout (``guard.Guard``); a refusal is
              answered, logged and counted there (``app.Rejections``), with no
              access line
  route       the two completion POSTs (``COMPLETIONS``): the body parsed as JSON by
              ``json.loads`` (as FastAPI does: a lone surrogate escape is left for
              the schema's check, which names the field) and validated by the
              route's pydantic model, then ``serving.Completions.handle``; every
              other request: FastAPI's router, whose routes declare their own
              parameters and models
  errors      a ``ServeError``, and the router's own refusals (FastAPI's validation
              errors, Starlette's 404 and 405) made into one, is logged and counted
              once (``app.Rejections``) and answered as OpenAI's error JSON (400 for
              a validation failure, not FastAPI's 422); any other exception is a
              bug: logged with its traceback, answered 500
  answer      a completion's JSON in one response (``http_server.JSONAnswer``), its
              stream through ``http_server.write_stream``; a client that leaves
              mid-stream cancels the stream (``serving.DisconnectWatch``), 499
  access log  one line per answered request (``runtime.logs.log_request``) with
              its status and the answer's ``x-request-id``

FastAPI declares the completion routes too, with their models, for the OpenAPI
document; their POSTs never reach its router. Through the router and Starlette's
middlewares a completion passed about ten ASGI levels (middlewares, routing,
dependency solving), each again on every ``send`` of its answer, the largest cost of
its HTTP path (docs/benchmarks.md, Coordinator overhead). Starlette's middleware
stack serves the lifespan only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.asyncexitstack import AsyncExitStackMiddleware
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import StreamingResponse

from pdserve.runtime.logs import log_request

from .errors import ServeError, validation_error
from .guard import Guard, send_error
from .http_server import write_stream
from .schemas import ChatCompletionRequest, CompletionRequest
from .serving import ClientGone, Completions, DisconnectWatch

log = logging.getLogger(__name__)
COMPLETIONS: dict[str, tuple[str, type[BaseModel]]] = {
    "/v1/completions": ("completions", CompletionRequest),
    "/v1/chat/completions": ("chat", ChatCompletionRequest),
}
"""The completion routes' paths: their endpoint name and request model."""
_WITH_BODY = frozenset(("POST", "PUT", "PATCH"))


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


def as_error(exc: Exception, path: str) -> ServeError:
    """The ``ServeError`` that answers ``exc``, raised while serving ``path``."""
    if isinstance(exc, ServeError):
        return exc
    if isinstance(exc, RequestValidationError):
        return validation_error(exc.errors(), 1)  # FastAPI's locations begin with "body"
    if isinstance(exc, HTTPException):
        return ServeError(exc.status_code, str(exc.detail), headers=exc.headers)
    log.error("unhandled error on %s", path, exc_info=exc)  # a bug: its traceback is wanted
    return ServeError(500, "internal error", code="internal_error")


class CoordinatorApp(FastAPI):
    """Built by ``create_app``, which declares the routes; uvicorn calls it per request."""

    def __init__(self, guard: Guard, rejections, completions: Completions, **fastapi) -> None:
        """``rejections``: ``app.Rejections``, which logs and counts each error answer."""
        super().__init__(**fastapi)
        self.guard = guard
        self.rejections = rejections
        self.completions = completions
        self.access_log = logging.getLogger("pdserve.access")
        # FastAPI's router, behind the one layer of FastAPI's stack its routes rely on:
        # the exit stack that closes what a request opened (uploaded files).
        self._routes = AsyncExitStackMiddleware(self.router)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)  # the lifespan
        start = time.monotonic()
        loop = asyncio.get_running_loop()  # once: on Python 3.11 each look-up is a getpid
        guard = self.guard
        refusal = guard.authorize(scope)
        if refusal is not None:
            return await guard.refuse(scope, send, refusal)
        method = scope["method"]
        body = None
        if method in _WITH_BODY:
            body = await guard.read_body(scope, receive, send, loop)
            if body is None:
                return
        completion = COMPLETIONS.get(scope["path"]) if method == "POST" else None
        if completion is None:
            return await self._route(scope, receive, send, body, start)
        await self._complete(scope, receive, send, body, completion, loop, start)

    async def _complete(self, scope, receive, send, body: bytes,
                        completion: tuple[str, type[BaseModel]], loop, start: float) -> None:
        """A completion POST: its body as the route's model, ``Completions.handle``, and
        its answer, JSON or a stream."""
        endpoint, model = completion
        try:
            response = await self.completions.handle(Request(scope, receive),
                                                     parse_body(body, model), endpoint, loop)
        except Exception as exc:
            return await self._refuse(scope, send, exc, start)
        status = response.status_code
        try:
            if isinstance(response, StreamingResponse):
                await send({"type": "http.response.start", "status": status,
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

    async def _route(self, scope, receive, send, body: bytes | None, start: float) -> None:
        """Every request but a completion's: FastAPI's router, with the body the guard
        read (``None``: a method without one, left to ``receive``)."""
        scope["app"] = self  # the router raises its 404 and 405 for an app to answer
        if body is not None:
            receive = _replay(body, receive)
        seen = _SeenSend(send)
        try:
            await self._routes(scope, receive, seen)
        except Exception as exc:
            if seen.status:  # the answer has begun: no error answer can follow it
                raise
            return await self._refuse(scope, send, exc, start)
        log_request(self.access_log, scope, seen.status, seen.request_id, start)

    async def _refuse(self, scope, send, exc: Exception, start: float) -> None:
        err = as_error(exc, scope["path"])
        self.rejections.record(scope["method"], scope["path"], err)
        await send_error(send, err)
        log_request(self.access_log, scope, err.status, err.headers.get("x-request-id"), start)


def _replay(body: bytes, receive):
    """``receive`` that gives ``body`` (read already) first, then the server's messages."""
    first = {"type": "http.request", "body": body, "more_body": False}

    async def replay():
        nonlocal first
        if first is not None:
            message, first = first, None
            return message
        return await receive()

    return replay


class _SeenSend:
    """A route's ``send``: notes the answer's status and ``x-request-id`` for its
    access line."""

    __slots__ = ("send", "status", "request_id")

    def __init__(self, send) -> None:
        self.send = send
        self.status = 0
        self.request_id: str | None = None

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            for name, value in message.get("headers", ()):
                if name.lower() == b"x-request-id":
                    self.request_id = value.decode("latin-1")
        await self.send(message)
