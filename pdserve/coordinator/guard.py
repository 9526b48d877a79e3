"""An ASGI middleware in front of every route: body-size limit and API-key auth.

Body limit: a request whose ``Content-Length`` or streamed body exceeds
``max_body_bytes`` gets 413 before any parsing; the body is buffered (it is small
by then) and replayed to the app, whose later ``receive`` calls reach the server
again (so disconnects are still seen). Auth: with an API key configured, paths
under ``/v1/`` need ``Authorization: Bearer <key>`` (compared in constant time);
/health, /ready, /metrics and the OpenAPI document stay open.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from .errors import ServeError


class GuardMiddleware:
    def __init__(self, app, max_body_bytes: int, api_key: str | None,
                 on_refuse: Callable[[dict, ServeError], None] | None = None) -> None:
        """``on_refuse(scope, error)`` is called for every request refused here (the
        app logs and counts it), before the answer is sent."""
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._key = f"Bearer {api_key}".encode() if api_key else None
        self._on_refuse = on_refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._key is not None and scope["path"].startswith("/v1/"):
            presented = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(presented, self._key):
                return await self._refuse(scope, send, ServeError(
                    401, "missing or wrong API key: send Authorization: Bearer <key>",
                    code="invalid_api_key"))
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > self.max_body_bytes:
                return await self._refuse(scope, send, self._too_large())
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await self._refuse(scope, send, self._too_large())
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replay = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay_receive():
            nonlocal replay
            if replay is not None:
                message, replay = replay, None
                return message
            return await receive()

        await self.app(scope, replay_receive, send)

    async def _refuse(self, scope, send, err: ServeError) -> None:
        if self._on_refuse is not None:
            self._on_refuse(scope, err)
        await _send_error(send, err)

    def _too_large(self) -> ServeError:
        return ServeError(413, f"request body larger than {self.max_body_bytes} bytes",
                          code="body_too_large")


async def _send_error(send, err: ServeError) -> None:
    body = err.json_bytes()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
