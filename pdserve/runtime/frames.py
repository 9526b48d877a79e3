"""The session wire: length-prefixed protobuf frames on one TCP (or TLS) connection.

The Coordinator's legs ride one session per engine, on the engine's session port
(``engine.session_server.FrameSessionServer``), which its Health answer names
(``HealthResponse.session_port``). Why not gRPC: over a gRPC stream every session
write and every response read is a completion that crosses gRPC's poller thread
into the event loop and an HTTP/2 frame of its own: the two legs of a PD request
cost the Coordinator 100-570 µs of CPU that way (docs/benchmarks.md, Coordinator
overhead). The same ``SessionRequest`` and ``SessionResponse`` messages as frames on
a plain asyncio connection cost a few µs each.

A frame is a 4-byte big-endian length and that many bytes. A connection:

  client  hello frame: ``HELLO`` followed by the cluster token (nothing without one)
  server  hello answer: ``OK``, or ``REFUSED`` and the reason, then it closes
  client  (after the OK) SessionRequest frames    server  SessionResponse frames

Invariants: the server allocates nothing for a peer before its hello passed (the
hello is at most ``MAX_HELLO_BYTES`` and must come within ``HELLO_TIMEOUT_S``);
a frame longer than the side's limit is a protocol error that closes the
connection, never a buffer grown to it; with TLS configured both sides require
certificates of the cluster CA, as the gRPC port does (``ssl_context``).
"""

from __future__ import annotations

import hmac
import ssl

from pdserve.runtime.security import SecuritySettings

HEADER_BYTES = 4
HELLO = b"pdserve-session/1 "
OK = b"ok"
REFUSED = b"refused: "
MAX_HELLO_BYTES = 1024
HELLO_TIMEOUT_S = 5.0
# A request frame carries a batch of prompts (128k-token prompts are ~0.6 MB each);
# a response frame a batch of messages. Past this the peer is broken or hostile.
MAX_FRAME_BYTES = 256 << 20


class FrameError(Exception):
    """The peer broke the wire's rules (a frame too long, a bad hello)."""


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(HEADER_BYTES, "big") + payload


def hello(token: str | None) -> bytes:
    return frame(HELLO + (token or "").encode())


def check_hello(payload: bytes, token: str | None) -> str | None:
    """Why the hello ``payload`` is refused (None: accepted), for a server whose
    cluster token is ``token`` (None: it takes any)."""
    if not payload.startswith(HELLO):
        return "not a pdserve session"
    presented = payload[len(HELLO):]
    if token is None:
        return None
    if not presented:
        return "no cluster token"
    return None if hmac.compare_digest(presented, token.encode()) else "wrong cluster token"


class FrameReader:
    """Splits the bytes a connection receives into frames of at most ``max_bytes``."""

    __slots__ = ("_buffer", "max_bytes")

    def __init__(self, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self.max_bytes = max_bytes  # raised once the hello passed; what is buffered stays

    def feed(self, data: bytes) -> list[bytes]:
        """The frames ``data`` completes, in order; raises ``FrameError`` for a frame
        longer than the limit (as soon as its header is in)."""
        if self._buffer:  # a frame split across reads: its start is buffered
            self._buffer += data
            data = bytes(self._buffer)
            self._buffer.clear()
        frames, start, end = [], 0, len(data)
        while end - start >= HEADER_BYTES:
            size = int.from_bytes(data[start:start + HEADER_BYTES], "big")
            if size > self.max_bytes:
                raise FrameError(f"a frame of {size} bytes (at most {self.max_bytes})")
            if end - start - HEADER_BYTES < size:
                break
            start += HEADER_BYTES
            frames.append(data[start:start + size])
            start += size
        if start < end:
            self._buffer += data[start:]
        return frames


def ssl_context(settings: SecuritySettings, server: bool) -> ssl.SSLContext | None:
    """mTLS with the cluster CA when configured (None without TLS): the server requires
    a client certificate, the client checks the server's, as gRPC's credentials do."""
    if not settings.uses_tls:
        return None
    purpose = ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH
    context = ssl.create_default_context(purpose, cafile=settings.tls_ca)
    context.load_cert_chain(settings.tls_cert, settings.tls_key)
    if server:
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def split_address(address: str) -> str:
    """The host of ``host:port`` (``[v6]:port`` too)."""
    host = address.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host

