"""Frame format and socket helpers of the transport control/data channel (no threads).

A frame is ``op:u8 | batch_id:u64 | body_len:u32`` (network order), then ``body``,
then for data-carrying ops a payload whose size the body's item table implies.
Payloads move with libc ``sendmsg``/``recvmsg`` over iovec arrays that point straight
into registered memory: no per-byte (or per-piece) Python objects, no extra copies.

Sockets are kernel-blocking with SO_RCVTIMEO/SO_SNDTIMEO (``configure``) rather than
Python timeouts: a Python timeout makes the fd non-blocking, which turns MSG_WAITALL
into a no-op and costs a poll() per call. A kernel timeout surfaces as
BlockingIOError; ``recv_exact`` maps it to Idle or TimeoutError.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import struct
from collections.abc import Iterator

import numpy as np

OP_HELLO = 1  # client -> server: json {"token", "endpoint"}
OP_WELCOME = 2  # server -> client: json info (registered regions, transport extras)
OP_REFUSE = 3  # server -> client: reason; the server then closes
OP_WRITE = 4  # body: item table (remote_addr, length); payload follows
OP_READ = 5  # body: item table; server answers OP_DATA + payload or OP_NACK
OP_DATA = 6
OP_ACK = 7
OP_NACK = 8  # body: utf-8 reason
OP_NOTIFY = 9  # body: the message; never answered
OP_FENCE = 10  # answered with OP_ACK once every earlier frame was handled

HEADER = struct.Struct("!BQI")
MAX_BODY_BYTES = 64 << 20
# Iovecs per sendmsg/recvmsg call: Linux's maximum (UIO_MAXIOV). A blocking sendmsg
# moves the whole window; a recvmsg with MSG_WAITALL sleeps until the window is full,
# so 64 MiB of 32 KiB pieces costs two calls and few wake-ups. Measured on loopback:
# 1024 beat 8 and 64 (windows of 8 cost ~25% more receiver CPU on scattered blocks).
SEND_WINDOW = 1024
RECV_WINDOW = 1024
_DRAIN_CHUNK_BYTES = 1 << 20


class Idle(Exception):
    """A read timed out before the first byte of a frame: the link is just quiet."""


def encode_table(remote_addrs: np.ndarray, lengths: np.ndarray) -> bytes:
    """Remote addresses and lengths as little-endian i64 pairs."""
    return np.stack([remote_addrs, lengths], axis=1).astype("<i8").tobytes()


def decode_table(body: bytes) -> tuple[np.ndarray, np.ndarray]:
    if len(body) % 16:
        raise ValueError(f"item table of {len(body)} bytes is not a multiple of 16")
    table = np.frombuffer(body, dtype="<i8").reshape(-1, 2).astype(np.int64)
    return table[:, 0], table[:, 1]


def send_frame(
    sock: socket.socket, op: int, batch_id: int = 0, body: bytes = b"", iov=None
) -> None:
    """One frame; ``iov`` (int64 array of (addr, length) rows) is its payload, if any."""
    sock.sendall(HEADER.pack(op, batch_id, len(body)) + body)
    if iov is not None and len(iov):
        send_payload(sock, iov)


def recv_frame(sock: socket.socket, *, idle_ok: bool = False) -> tuple[int, int, bytes]:
    """Read one header and body. With ``idle_ok`` a timeout before any byte raises Idle."""
    header = recv_exact(sock, HEADER.size, idle_ok=idle_ok)
    op, batch_id, body_len = HEADER.unpack(header)
    if body_len > MAX_BODY_BYTES:
        raise ValueError(f"frame body of {body_len} bytes exceeds {MAX_BODY_BYTES}")
    return op, batch_id, recv_exact(sock, body_len) if body_len else b""


def recv_frames(sock: socket.socket) -> Iterator[tuple[int, int, bytes]]:
    """Frames until the connection fails (the error propagates); quiet spells are skipped."""
    while True:
        try:
            frame = recv_frame(sock, idle_ok=True)
        except Idle:
            continue
        yield frame


def shutdown(sock: socket.socket) -> None:
    """Wake every thread blocked on ``sock``; the thread that owns it closes it later."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def configure(sock: socket.socket, timeout_s: float) -> None:
    """Blocking I/O bounded by kernel timeouts, no Nagle delay on small control frames."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    whole = int(timeout_s)
    timeval = struct.pack("ll", whole, int((timeout_s - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def recv_exact(sock: socket.socket, num_bytes: int, *, idle_ok: bool = False) -> bytes:
    buf = bytearray(num_bytes)
    view = memoryview(buf)
    got = 0
    while got < num_bytes:
        try:
            n = sock.recv_into(view[got:])
        except (TimeoutError, BlockingIOError):
            if idle_ok and got == 0:
                raise Idle() from None
            raise TimeoutError("peer stalled in the middle of a frame") from None
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n
    return bytes(buf)


def drain(sock: socket.socket, num_bytes: int) -> None:
    """Discard ``num_bytes`` of payload (a refused batch) to keep the stream in step."""
    scratch = memoryview(bytearray(min(num_bytes, _DRAIN_CHUNK_BYTES) or 1))
    while num_bytes > 0:
        n = sock.recv_into(scratch, min(num_bytes, len(scratch)))
        if n == 0:
            raise ConnectionError("peer closed the connection mid-payload")
        num_bytes -= n


# -- payloads: scatter/gather straight from/into registered memory ----------------------
# The iovec array is built by numpy (no Python object per KV piece) and handed to libc
# sendmsg/recvmsg through ctypes, which releases the GIL for the call. The caller keeps
# the socket object alive (and so its fd unclosed) for the whole call.


class _MsgHdr(ctypes.Structure):
    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.c_void_p),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
for _fn in (_libc.sendmsg, _libc.recvmsg):
    _fn.argtypes = [ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int]
    _fn.restype = ctypes.c_ssize_t


def send_payload(sock: socket.socket, iov: np.ndarray) -> None:
    """Send every (addr, length) run in order; a blocking sendmsg moves a whole window."""
    _iov_loop(sock, iov, _libc.sendmsg, socket.MSG_NOSIGNAL, SEND_WINDOW)


def recv_payload(sock: socket.socket, iov: np.ndarray) -> None:
    """Fill every (addr, length) run in order; MSG_WAITALL fills a window per call."""
    _iov_loop(sock, iov, _libc.recvmsg, socket.MSG_WAITALL, RECV_WINDOW)


def _iov_loop(sock: socket.socket, iov: np.ndarray, call, flags: int, window: int) -> None:
    iov = np.ascontiguousarray(iov, dtype=np.uint64).copy()  # rows are struct iovec
    lengths = iov[:, 1].tolist()
    hdr = _MsgHdr()
    base, i, n = iov.ctypes.data, 0, len(iov)
    while i < n:
        k = min(window, n - i)
        hdr.msg_iov, hdr.msg_iovlen = base + 16 * i, k
        done = call(sock.fileno(), ctypes.byref(hdr), flags)
        if done < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise TimeoutError("peer made no progress within the socket timeout")
            raise OSError(err, os.strerror(err))
        if done == 0 and call is _libc.recvmsg:
            raise ConnectionError("peer closed the connection mid-payload")
        while done and i < n:  # usually the whole window: one pass per row
            if done >= lengths[i]:
                done -= lengths[i]
                i += 1
            else:
                iov[i, 0] += done
                iov[i, 1] -= done
                lengths[i] -= done
                done = 0
