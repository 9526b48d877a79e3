"""Our connection to one peer's channel: a sender thread running jobs, a reader for replies.

``Channel.link(peer)`` creates one ``PeerLink`` per peer endpoint; transports submit
jobs to it (``ChannelTransport._run``, ``notify``), and the jobs speak the wire
protocol on ``sock`` from the sender thread.

Invariants:
- A link runs jobs in submission order on its one sender thread, so a notify is
  delivered after every batch submitted before it to the same peer.
- Connecting is a handshake bounded by ``handshake_timeout_s``: HELLO with our token,
  then WELCOME (the peer's info) or REFUSE (its reason, raised).
- When a link breaks (I/O error, EOF, or a batch past its deadline) every batch
  waiting on it is FAILED and the socket shut down; the next job reconnects.
- Payload I/O uses raw fds (wire.py), so a link socket is only ever *closed* by the
  sender thread once its reader thread has exited. Other threads only shut it down.
- A link drops its socket after half the idle deadline without a job, so the peer's
  idle deadline never cuts a link we are about to use.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.engine.kv_transfer.transport import wire
from pdserve.engine.kv_transfer.transport.base import BatchHandle
from pdserve.runtime.queues import items_until_none

if TYPE_CHECKING:
    from pdserve.engine.kv_transfer.transport.channel import Channel

log = logging.getLogger(__name__)

# Runs on a link's reader thread when the reply for a batch arrives.
ReplyHandler = Callable[[socket.socket, int, bytes], None]
_SWEEP_S = 0.2


def _nothing(link: PeerLink) -> None:
    """A job that only wakes the sender (``reset``)."""


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
        self._last_job_s = time.monotonic()
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
        timeout_s, handshake_s = self.channel.timeout_s, self.channel.limits.handshake_timeout_s
        deadline = time.monotonic() + handshake_s
        sock = socket.create_connection((host, int(port)), timeout=min(timeout_s, handshake_s))
        try:
            wire.configure(sock, min(timeout_s, handshake_s))
            hello = {"token": self.channel.auth_token, "endpoint": self.channel.endpoint}
            wire.send_frame(sock, wire.OP_HELLO, body=json.dumps(hello).encode())
            op, _, body = wire.recv_frame(sock, wire.WELCOME_LIMITS, timeout_s, deadline=deadline)
            if op == wire.OP_REFUSE:
                reason = body.decode(errors="replace")
                raise ConnectionRefusedError(f"peer {self.peer} refused us: {reason}")
            self.info = json.loads(body)
            if not isinstance(self.info, dict):
                raise wire.FrameError("malformed WELCOME", "not a JSON object")
            wire.configure(sock, timeout_s)
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
        self._jobs.put((None, _nothing))  # the sender sweeps the retired socket soon
        wire.shutdown(sock)
        for handle, _ in pending.values():
            handle.fail(f"connection to {self.peer} lost: {reason}")

    def close(self) -> None:
        self._closed = True
        self.reset(self.sock, "transport closed")
        self._jobs.put(None)

    def _send_loop(self) -> None:
        for handle, job in items_until_none(self._jobs, self._sweep_wait, self._sweep):
            if handle is not None and not handle.status().is_pending:
                continue  # timed out while queued
            self._last_job_s = time.monotonic()
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

    def _sweep_wait(self) -> float | None:
        """How long the sender may wait for a job before ``_sweep`` has work: a batch's
        deadline to check or a retired socket to close (``_SWEEP_S``), the open socket's
        idle close; with none of them, until the next job. An idle link costs no wakeups:
        an engine holds one per peer it ever reached, and a cluster's engines reach all
        of their partners (the Coordinators' pair probes)."""
        with self._lock:
            if self._pending or self._retired:
                return _SWEEP_S
            if self.sock is None:
                return None
            idle_s = time.monotonic() - self._last_job_s
        return max(_SWEEP_S, self.channel.limits.idle_timeout_s / 2 - idle_s)

    def _sweep(self) -> None:
        """Sender thread, between jobs: drop a stuck peer or an idle socket, close sockets
        nobody reads."""
        with self._lock:
            expired = any(not h.status().is_pending for h, _ in self._pending.values())
            idle_s = 0.0 if self._pending else time.monotonic() - self._last_job_s
        if expired:
            self.reset(self.sock, "peer did not answer before the deadline")
        elif idle_s > self.channel.limits.idle_timeout_s / 2:
            self.reset(self.sock, "idle")
        with self._lock:
            idle = [(s, done) for s, done in self._retired if done.is_set()]
            self._retired = [r for r in self._retired if not r[1].is_set()]
        for sock, _ in idle:
            sock.close()

    def _read_loop(self, sock: socket.socket, done: threading.Event) -> None:
        try:
            for op, batch_id, body in wire.recv_frames(sock, wire.REPLY_LIMITS,
                                                       self.channel.timeout_s):
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
