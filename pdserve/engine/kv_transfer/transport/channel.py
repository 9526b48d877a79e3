"""The TCP channel every transport uses: listener, auth handshake, notify, per-peer links.

``Channel`` owns one listening socket (its address is the transport's endpoint), the
server half of every connection peers open to it, and one ``PeerLink`` (link.py) per
peer we talk to. tcp.py carries KV bytes on it; shm.py and mooncake.py carry only
handshakes, fences and notifications on it.

Invariants:
- A connection past the caps (``ChannelLimits``: in all; handshakes per peer host)
  is answered REFUSE at accept and closed, without a thread or a read.
- Every connection starts with HELLO (at most ``wire.MAX_HELLO_BYTES``) within the
  handshake deadline; a wrong token, a malformed HELLO or any other first frame is
  answered REFUSE with the reason and closed before any other frame is read. No
  frame larger than the HELLO is read, or memory allocated for it, before that.
- Each op has a largest body (wire.py); a frame outside them, or an authenticated
  connection silent for ``idle_timeout_s``, closes the connection. Every refusal is
  logged with its reason, rate-limited per peer host (``limits.RefusalLog``).
- A server connection is closed only by its own thread; ``close`` shuts it down.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping

from pdserve.engine.kv_transfer.transport import wire
from pdserve.engine.kv_transfer.transport.limits import (
    Admission,
    ChannelLimits,
    RefusalLog,
    check_hello,
)
from pdserve.engine.kv_transfer.transport.link import PeerLink

log = logging.getLogger(__name__)

# (sock, op, batch_id, body, peer) -> None; reads the payload and writes the reply itself.
FrameHandler = Callable[[socket.socket, int, int, bytes, str], None]


class Channel:
    """Listener plus links. Created by ``ChannelTransport`` from its transport's options
    (the transport states their defaults); ``info`` feeds the WELCOME reply."""

    def __init__(
        self, *, info: Callable[[], dict], on_frame: FrameHandler | None, host: str, port: int,
        advertise_host: str | None, auth_token: str | None, timeout_s: float,
        limits: ChannelLimits | None = None, frame_limits: Mapping[int, int] | None = None,
        on_close: Callable[[socket.socket], None] | None = None,
    ) -> None:
        """``frame_limits``: the ops ``on_frame`` serves and their largest bodies (default
        tcp's, ``wire.DATA_LIMITS``); ``on_close(sock)`` runs once a served connection ended."""
        self.timeout_s = timeout_s
        self.auth_token = auth_token
        self.limits = limits = limits or ChannelLimits()
        self._info = info
        self._on_frame = on_frame
        served = (wire.DATA_LIMITS if frame_limits is None else frame_limits) if on_frame else {}
        self._frame_limits = {**wire.CHANNEL_LIMITS, **served}
        self._on_close = on_close
        self._admission = Admission(limits)
        self._refusals = RefusalLog(log, limits.refusal_log_every_s)
        self._notes: queue.SimpleQueue[tuple[str, bytes, float]] = queue.SimpleQueue()
        self.on_notify: Callable[[], None] | None = None  # Transport.set_notify_hook
        self._lock = threading.Lock()
        self._links: dict[str, PeerLink] = {}
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._listener = socket.create_server((host, port), backlog=64)
        self.endpoint = f"{advertise_host or host}:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True).start()

    def link(self, peer: str) -> PeerLink:
        with self._lock:
            if self._closed:
                raise RuntimeError("transport is closed")
            if peer not in self._links:
                self._links[peer] = PeerLink(self, peer)
            return self._links[peer]

    def notifications(self) -> list[tuple[str, bytes, float]]:
        out = []
        while True:
            try:
                out.append(self._notes.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links, conns = list(self._links.values()), list(self._conns)
        wire.shutdown(self._listener)  # wakes the accept thread; close() alone does not
        self._listener.close()
        for link in links:
            link.close()
        for conn in conns:
            wire.shutdown(conn)  # its serving thread closes it

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            host = addr[0]
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                refusal = self._admission.enter(host)
                if refusal is None:
                    self._conns.add(sock)
            if refusal is not None:
                self._refusals.refused(host, "connection cap", refusal)
                _refuse_now(sock, refusal)
                continue
            threading.Thread(
                target=self._serve, args=(sock, addr), name="kv-serve", daemon=True
            ).start()

    def _serve(self, sock: socket.socket, addr) -> None:
        """Server half of one connection: handshake, then frames until EOF."""
        host, is_authenticated = addr[0], False
        try:
            wire.configure(sock, min(self.timeout_s, self.limits.handshake_timeout_s))
            endpoint = self._check_hello(sock, host)
            self._admission.authenticated(host)  # before WELCOME: the peer may dial again at once
            is_authenticated = True
            wire.send_frame(sock, wire.OP_WELCOME, body=json.dumps(self._info()).encode())
            peer = endpoint or f"{host}:{addr[1]}"
            wire.configure(sock, self.timeout_s)
            frames = wire.recv_frames(
                sock, self._frame_limits, self.timeout_s, self.limits.idle_timeout_s)
            for op, batch_id, body in frames:
                if op == wire.OP_NOTIFY:
                    self._notes.put((peer, body, time.monotonic()))
                    if self.on_notify is not None:
                        self.on_notify()
                elif op == wire.OP_FENCE:
                    wire.send_frame(sock, wire.OP_ACK, batch_id)
                else:
                    self._on_frame(sock, op, batch_id, body, peer)
        except _Refused:
            pass  # answered and logged
        except wire.FrameError as exc:
            self._refusals.refused(host, exc.kind, exc.detail, verb="closed")
        except wire.IdleTimeout as exc:
            self._refusals.refused(host, "idle timeout", str(exc), verb="closed")
        except (OSError, ValueError) as exc:
            log.debug("KV connection from %s ended: %s", addr, exc)
        finally:
            with self._lock:
                self._conns.discard(sock)
            self._admission.leave(host, is_authenticated)
            if self._on_close is not None:
                self._on_close(sock)
            sock.close()

    def _check_hello(self, sock: socket.socket, host: str) -> str | None:
        """Read and check the HELLO; returns the endpoint it names (the caller answers
        WELCOME). Raises _Refused once a bad or late HELLO was answered and logged."""
        deadline = time.monotonic() + self.limits.handshake_timeout_s
        try:
            _, _, body = wire.recv_frame(sock, wire.HELLO_LIMITS, self.timeout_s, deadline=deadline)
            endpoint = check_hello(body, self.auth_token)
        except wire.FrameError as exc:
            self._refusals.refused(host, exc.kind, exc.detail)
            wire.send_frame(sock, wire.OP_REFUSE, body=str(exc).encode())
            raise _Refused() from None
        except TimeoutError:
            self._refusals.refused(
                host, "handshake timeout",
                f"no whole HELLO within {self.limits.handshake_timeout_s:g} s")
            raise _Refused() from None
        return endpoint


class _Refused(Exception):
    """The handshake refused the connection; it was answered and logged."""


def _refuse_now(sock: socket.socket, reason: str) -> None:
    """Accept thread: one REFUSE frame and close, never blocking (the send buffer of a
    fresh socket has room for it)."""
    try:
        sock.setblocking(False)
        body = reason.encode()
        sock.send(wire.HEADER.pack(wire.OP_REFUSE, 0, len(body)) + body)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        sock.close()
