"""The checks every HTTP request passes first: body-size limit, body timeout and auth.

``front.CoordinatorApp`` applies them to every route, before routing.

Body: a request whose ``Content-Length`` or streamed body exceeds ``max_body_bytes``
gets 413 before any parsing, one whose body has not all arrived ``body_timeout_s``
after its headers gets 408 (and the connection closes: a half-sent request holds no
slot). The body is read whole (it is small by then) and handed to the route.

Auth, with keys compared in constant time:

  /v1/*        with an API key configured: ``Authorization: Bearer <API or admin key>``
  /ui, /ui/*   with either key configured: the same, or HTTP Basic with the key as
               the password (a 401 asks the browser for it), since the status page
               shows the cluster's engines and their addresses
  elsewhere    open: /health, /ready, /metrics, the OpenAPI document, / (a redirect)

Every request's scope carries ``ADMIN_SCOPE_KEY``: whether it presented the admin
key, which alone sees engine addresses in a request's timings (``serving``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
from collections.abc import Callable

from .errors import ServeError

ADMIN_SCOPE_KEY = "pdserve.is_admin"


def _is_ui(path: str) -> bool:
    return path == "/ui" or path.startswith("/ui/")


def _presents(authorization: bytes, key: bytes | None, allow_basic: bool) -> bool:
    """``authorization`` (the header's value) carries ``key``: as a bearer token, or
    with ``allow_basic`` as the password of HTTP Basic auth (any user name)."""
    if key is None:
        return False
    if hmac.compare_digest(authorization, b"Bearer " + key):
        return True
    if not (allow_basic and authorization[:6].lower() == b"basic "):
        return False
    try:
        credentials = base64.b64decode(authorization[6:].strip(), validate=True)
    except (binascii.Error, ValueError):
        return False
    return hmac.compare_digest(credentials.partition(b":")[2], key)


class Guard:
    """The checks; ``front.CoordinatorApp`` calls them for every request."""

    def __init__(self, max_body_bytes: int, api_key: str | None,
                 on_refuse: Callable[[dict, ServeError], None] | None = None, *,
                 admin_key: str | None = None, body_timeout_s: float = 30.0) -> None:
        """``on_refuse(scope, error)`` is called for every request refused here (the
        app logs and counts it), before the answer is sent."""
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self._key = api_key.encode() if api_key else None
        self._admin_key = admin_key.encode() if admin_key else None
        self._on_refuse = on_refuse

    async def read_body(self, scope, receive, send,
                        loop: asyncio.AbstractEventLoop | None = None) -> bytes | None:
        """The whole body, within the size limit and the body timeout; None when it was
        refused here (answered already) or the client left before sending it. ``loop``:
        the running loop, when the caller has it."""
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > self.max_body_bytes:
                await self.refuse(scope, send, self._too_large())
                return None
        loop = loop or asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        # asyncio.timeout's work, without its look-ups of the running loop (a getpid each).
        timer = loop.call_later(self.body_timeout_s, expire)
        chunks, size = [], 0
        try:
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return None  # the client left before sending its body
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    break
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        except asyncio.CancelledError:
            if not expired:
                raise
            task.uncancel()
            await self.refuse(scope, send, ServeError(
                408, f"the request body did not arrive within {self.body_timeout_s:g}s",
                code="body_timeout", headers={"Connection": "close"}))
            return None
        finally:
            timer.cancel()
        if size > self.max_body_bytes:
            await self.refuse(scope, send, self._too_large())
            return None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def authorize(self, scope) -> ServeError | None:
        """Marks the scope admin or not; the refusal when the path needs a key it lacks."""
        path = scope["path"]
        is_ui = _is_ui(path)
        presented = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        is_admin = _presents(presented, self._admin_key, is_ui)
        scope[ADMIN_SCOPE_KEY] = is_admin
        if is_ui:
            needs_key = self._key is not None or self._admin_key is not None
        else:
            needs_key = self._key is not None and path.startswith("/v1/")
        if not needs_key or is_admin or _presents(presented, self._key, is_ui):
            return None
        if is_ui:
            return ServeError(401, "the status page needs the API key (as a bearer token, or as "
                              "the password when the browser asks)", code="invalid_api_key",
                              headers={"WWW-Authenticate": 'Basic realm="pdserve", charset="UTF-8"'})
        return ServeError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                          code="invalid_api_key")

    async def refuse(self, scope, send, err: ServeError) -> None:
        if self._on_refuse is not None:
            self._on_refuse(scope, err)
        await send_error(send, err)

    def _too_large(self) -> ServeError:
        return ServeError(413, f"request body larger than {self.max_body_bytes} bytes",
                          code="body_too_large")


async def send_error(send, err: ServeError) -> None:
    """``err`` as OpenAI's error JSON, with its status and headers."""
    body = err.json_bytes()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
