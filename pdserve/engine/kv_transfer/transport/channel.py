"""The TCP channel every transport uses: listener, auth handshake, notify, per-peer links.

``Channel`` owns one listening socket (its address is the transport's endpoint) and
one ``PeerLink`` per peer we talk to. tcp.py carries KV bytes on it; shm.py and
mooncake.py carry only handshakes, fences and notifications on it.

Invariants:
- Every connection starts with HELLO; with an ``auth_token`` set, a wrong token is
  answered REFUSE with the reason, logged, and closed before any other frame is read.
- A link runs jobs in submission order on its one sender thread, so a notify is
  delivered after every batch submitted before it to the same peer.
- When a link breaks (I/O error, EOF, or a batch past its deadline) every batch
  waiting on it is FAILED and the socket shut down; the next job reconnects.
- Payload I/O uses raw fds (wire.py), so a socket is only ever *closed* by the thread
  that last uses it: a server connection by its own thread, a link socket by the
  sender thread once its reader thread has exited. Other threads only shut it down.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable

from pdserve.engine.kv_transfer.transport import wire
from pdserve.engine.kv_transfer.transport.base import BatchHandle

log = logging.getLogger(__name__)

# (sock, op, batch_id, body, peer) -> None; reads the payload and writes the reply itself.
FrameHandler = Callable[[socket.socket, int, int, bytes, str], None]
# Runs on a link's reader thread when the reply for a batch arrives.
ReplyHandler = Callable[[socket.socket, int, bytes], None]
_SWEEP_S = 0.2


class Channel:
    """Listener plus links. Created by ``ChannelTransport`` from its transport's options
    (the transport states their defaults); ``info`` feeds the WELCOME reply."""

    def __init__(
        self, *, info: Callable[[], dict], on_frame: FrameHandler | None, host: str, port: int,
        advertise_host: str | None, auth_token: str | None, timeout_s: float,
    ) -> None:
        self.timeout_s = timeout_s
        self.auth_token = auth_token
        self._info = info
        self._on_frame = on_frame
        self._notes: queue.SimpleQueue[tuple[str, bytes, float]] = queue.SimpleQueue()
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
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns.add(sock)
            threading.Thread(
                target=self._serve, args=(sock, addr), name="kv-serve", daemon=True
            ).start()

    def _serve(self, sock: socket.socket, addr) -> None:
        """Server half of one connection: handshake, then frames until EOF."""
        try:
            wire.configure(sock, self.timeout_s)
            op, _, body = wire.recv_frame(sock)
            hello = json.loads(body) if op == wire.OP_HELLO else {}
            peer = str(hello.get("endpoint") or f"{addr[0]}:{addr[1]}")
            if op != wire.OP_HELLO or not self._is_authorized(hello.get("token")):
                reason = "bad auth token" if op == wire.OP_HELLO else "expected HELLO"
                log.warning("refused KV connection from %s (%s): %s", addr, peer, reason)
                wire.send_frame(sock, wire.OP_REFUSE, body=reason.encode())
                return
            wire.send_frame(sock, wire.OP_WELCOME, body=json.dumps(self._info()).encode())
            for op, batch_id, body in wire.recv_frames(sock):
                if op == wire.OP_NOTIFY:
                    self._notes.put((peer, body, time.monotonic()))
                elif op == wire.OP_FENCE:
                    wire.send_frame(sock, wire.OP_ACK, batch_id)
                elif self._on_frame is not None:
                    self._on_frame(sock, op, batch_id, body, peer)
                else:
                    raise ValueError(f"unexpected op {op}")
        except (OSError, ValueError) as exc:
            log.debug("KV connection from %s ended: %s", addr, exc)
        finally:
            with self._lock:
                self._conns.discard(sock)
            sock.close()

    def _is_authorized(self, token) -> bool:
        if not self.auth_token:
            return True
        return isinstance(token, str) and hmac.compare_digest(token, self.auth_token)


class PeerLink:
    """Our connection to one peer: a sender thread running jobs, a reader thread for replies.

    Transports call ``submit``; jobs run on the sender thread and call ``connect``,
    ``expect`` and ``wire.send_*`` on ``sock``.
    """

    def __init__(self, channel: Channel, peer: str) -> None:
        self.channel = channel
        self.peer = peer
        self.sock: socket.socket | None = None
        self.info: dict = {}
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[BatchHandle, ReplyHandler]] = {}
        self._retired: list[tuple[socket.socket, threading.Event]] = []
        self._reader_done: threading.Event | None = None
        self._closed = False
        threading.Thread(target=self._send_loop, name=f"kv-send-{peer}", daemon=True).start()

    def submit(self, handle: BatchHandle | None, job: Callable[[PeerLink], None]) -> None:
        """Queue ``job``; if it raises, ``handle`` fails with the reason and the link resets."""
        if self._closed:
            if handle is not None:
                handle.fail("transport is closed")
            return
        self._jobs.put((handle, job))

    def connect(self) -> socket.socket:
        """On the sender thread: (re)connect and handshake; returns the live socket."""
        if self.sock is not None:
            return self.sock
        host, _, port = self.peer.rpartition(":")
        timeout_s = self.channel.timeout_s
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        try:
            wire.configure(sock, timeout_s)
            hello = {"token": self.channel.auth_token, "endpoint": self.channel.endpoint}
            wire.send_frame(sock, wire.OP_HELLO, body=json.dumps(hello).encode())
            op, _, body = wire.recv_frame(sock)
            if op == wire.OP_REFUSE:
                raise ConnectionRefusedError(f"peer {self.peer} refused us: {body.decode()}")
            if op != wire.OP_WELCOME:
                raise ConnectionError(f"peer {self.peer} answered op {op} to HELLO")
            self.info = json.loads(body)
        except BaseException:
            sock.close()
            raise
        self.sock, self._reader_done = sock, threading.Event()
        threading.Thread(
            target=self._read_loop, args=(sock, self._reader_done),
            name=f"kv-recv-{self.peer}", daemon=True,
        ).start()
        return sock

    def expect(self, handle: BatchHandle, on_reply: ReplyHandler) -> None:
        """Register the reply handler for ``handle`` before sending its request."""
        with self._lock:
            self._pending[handle.batch_id] = (handle, on_reply)

    def reset(self, sock: socket.socket | None, reason: str) -> None:
        """Shut ``sock`` down (if still current) and fail every batch waiting on it."""
        with self._lock:
            if sock is None or sock is not self.sock:
                return
            self.sock = None
            pending, self._pending = self._pending, {}
            self._retired.append((sock, self._reader_done))
        wire.shutdown(sock)
        for handle, _ in pending.values():
            handle.fail(f"connection to {self.peer} lost: {reason}")

    def close(self) -> None:
        self._closed = True
        self.reset(self.sock, "transport closed")
        self._jobs.put(None)

    def _send_loop(self) -> None:
        while True:
            try:
                entry = self._jobs.get(timeout=_SWEEP_S)
            except queue.Empty:
                self._sweep()
                continue
            if entry is None:
                break
            handle, job = entry
            if handle is not None and not handle.status().is_pending:
                continue  # timed out while queued
            try:
                job(self)
            except (OSError, ValueError, RuntimeError) as exc:
                if handle is not None:
                    handle.fail(f"{type(exc).__name__}: {exc}")
                else:
                    log.warning("KV notify to %s failed: %s", self.peer, exc)
                self.reset(self.sock, str(exc) or type(exc).__name__)
            self._sweep()
        while not self._jobs.empty():
            entry = self._jobs.get_nowait()
            if entry is not None and entry[0] is not None:
                entry[0].fail("transport is closed")
        for sock, reader_done in self._retired:
            if reader_done.wait(1.0):
                sock.close()

    def _sweep(self) -> None:
        """Sender thread, between jobs: drop a stuck peer, close sockets nobody reads."""
        with self._lock:
            expired = any(not h.status().is_pending for h, _ in self._pending.values())
        if expired:
            self.reset(self.sock, "peer did not answer before the deadline")
        with self._lock:
            idle = [(s, done) for s, done in self._retired if done.is_set()]
            self._retired = [r for r in self._retired if not r[1].is_set()]
        for sock, _ in idle:
            sock.close()

    def _read_loop(self, sock: socket.socket, done: threading.Event) -> None:
        try:
            for op, batch_id, body in wire.recv_frames(sock):
                with self._lock:
                    handle, on_reply = self._pending.pop(batch_id, (None, None))
                if on_reply is None:
                    raise ValueError(f"reply op {op} for unknown batch {batch_id}")
                try:
                    on_reply(sock, op, body)
                except (OSError, ValueError) as exc:
                    handle.fail(f"{type(exc).__name__}: {exc}")
                    raise
        except (OSError, ValueError) as exc:
            self.reset(sock, str(exc) or type(exc).__name__)
        finally:
            done.set()
