"""Frame format and socket helpers of the transport control/data channel (no threads).

A frame is ``op:u8 | batch_id:u64 | body_len:u32`` (network order), then ``body``,
then for data-carrying ops a payload whose size the body's item table implies.
Payloads move with libc ``sendmsg``/``recvmsg`` over iovec arrays that point straight
into registered memory: no per-byte (or per-piece) Python objects, no extra copies.

Sockets are kernel-blocking with SO_RCVTIMEO/SO_SNDTIMEO (``configure``) rather than
Python timeouts: a Python timeout makes the fd non-blocking, which turns MSG_WAITALL
into a no-op and costs a poll() per call. A kernel timeout surfaces as
BlockingIOError; ``recv_exact`` maps it to Idle or TimeoutError.

Limits (the KV port faces the network): a reader names the ops it accepts and each
op's largest body (``HELLO_LIMITS`` before a peer authenticated; ``CHANNEL_LIMITS``,
plus ``DATA_LIMITS`` for tcp or ``LANDING_LIMITS`` for mooncake, after; ``WELCOME_LIMITS`` and ``REPLY_LIMITS`` on our
own links). ``recv_frame`` checks the op and the length from the
13-byte header before it reads or allocates any body, and then allocates only as
bytes arrive, so a header that promises 64 MiB costs nothing until 64 MiB come. A
body must be whole within its deadline once its header arrived; a handshake's frame
within the handshake's.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import socket
import struct
import time
from collections.abc import Iterator, Mapping

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
# Mooncake's landing buffer (staging.py): a peer's pieces moved as one segment each way.
OP_LAND = 11  # client -> server: lend this connection a landing buffer; OP_LANDING or OP_NACK
OP_LANDING = 12  # server -> client: json {"addr", "slot_bytes", "num_slots"}
OP_SCATTER = 13  # body: u64 landing offset + item table; copy landing -> items, then OP_ACK
OP_GATHER = 14  # body: the same; copy items -> landing, then OP_ACK

HEADER = struct.Struct("!BQI")
MAX_HELLO_BYTES = 4 << 10  # token and endpoint: what an unauthenticated peer may send
MAX_INFO_BYTES = 1 << 20  # WELCOME: regions, shm segments, Mooncake session
MAX_REASON_BYTES = 64 << 10  # REFUSE and NACK reasons
MAX_NOTIFY_BYTES = 4 << 20  # connector messages; RESERVE of 100k blocks is ~1 MiB
MAX_TABLE_BYTES = 64 << 20  # WRITE/READ item tables: 4M (addr, length) pairs
# op -> largest body, for each side of a connection.
HELLO_LIMITS: Mapping[int, int] = {OP_HELLO: MAX_HELLO_BYTES}
CHANNEL_LIMITS: Mapping[int, int] = {OP_NOTIFY: MAX_NOTIFY_BYTES, OP_FENCE: 0}
DATA_LIMITS: Mapping[int, int] = {OP_WRITE: MAX_TABLE_BYTES, OP_READ: MAX_TABLE_BYTES}  # tcp
WELCOME_LIMITS: Mapping[int, int] = {OP_WELCOME: MAX_INFO_BYTES, OP_REFUSE: MAX_REASON_BYTES}
LANDING_LIMITS: Mapping[int, int] = {  # mooncake
    OP_LAND: 0, OP_SCATTER: 8 + MAX_TABLE_BYTES, OP_GATHER: 8 + MAX_TABLE_BYTES}
REPLY_LIMITS: Mapping[int, int] = {OP_ACK: 0, OP_DATA: 0, OP_NACK: MAX_REASON_BYTES,
                                   OP_LANDING: 256}
OP_NAMES = {OP_HELLO: "HELLO", OP_WELCOME: "WELCOME", OP_REFUSE: "REFUSE", OP_WRITE: "WRITE",
            OP_READ: "READ", OP_DATA: "DATA", OP_ACK: "ACK", OP_NACK: "NACK",
            OP_NOTIFY: "NOTIFY", OP_FENCE: "FENCE", OP_LAND: "LAND", OP_LANDING: "LANDING",
            OP_SCATTER: "SCATTER", OP_GATHER: "GATHER"}
# A window is what one sendmsg/recvmsg call is given: at most WINDOW_IOVECS iovecs
# (Linux's UIO_MAXIOV) and at most *_WINDOW_BYTES bytes, a longer run being cut into
# window-sized rows first (``split_rows``). A blocking sendmsg moves its whole window;
# a recvmsg with MSG_WAITALL sleeps until its window is full. Receive windows are
# bounded by bytes, not only by count: counted in iovecs alone, a coalesced 64 MiB run
# was one recvmsg and measured 67-68% of a raw socket on loopback, where scattered
# 32 KiB pieces (windows of 1024) measured 88-98%. 4 MiB keeps a call near one socket
# buffer's worth (a common net.core.rmem_max), 16 calls per 64 MiB. Measured on loopback:
# 1024 iovecs beat 8 and 64 (windows of 8 cost ~25% more receiver CPU).
WINDOW_IOVECS = 1024
SEND_WINDOW_BYTES = 64 << 20
RECV_WINDOW_BYTES = 4 << 20
_DRAIN_CHUNK_BYTES = 1 << 20
_RECV_CHUNK_BYTES = 1 << 20  # a body is read (and its memory grown) this much at a time


class Idle(Exception):
    """A read timed out before the first byte of a frame: the link is just quiet."""


class IdleTimeout(TimeoutError):
    """No frame arrived for the connection's idle deadline (``recv_frames``)."""


class FrameError(ValueError):
    """A frame the reader does not accept; ``kind`` is the short reason a log line keys on."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


def encode_table(remote_addrs: np.ndarray, lengths: np.ndarray) -> bytes:
    """Remote addresses and lengths as little-endian i64 pairs."""
    return np.stack([remote_addrs, lengths], axis=1).astype("<i8").tobytes()


def decode_table(body: bytes) -> tuple[np.ndarray, np.ndarray]:
    if len(body) % 16:
        raise FrameError("malformed item table", f"{len(body)} bytes is not a multiple of 16")
    table = np.frombuffer(body, dtype="<i8").reshape(-1, 2).astype(np.int64)
    return table[:, 0], table[:, 1]


def send_frame(
    sock: socket.socket, op: int, batch_id: int = 0, body: bytes = b"", iov=None
) -> None:
    """One frame; ``iov`` (int64 array of (addr, length) rows) is its payload, if any."""
    sock.sendall(HEADER.pack(op, batch_id, len(body)) + body)
    if iov is not None and len(iov):
        send_payload(sock, iov)


def recv_frame(
    sock: socket.socket, limits: Mapping[int, int], timeout_s: float, *,
    deadline: float | None = None, idle_ok: bool = False,
) -> tuple[int, int, bytes]:
    """Read one header and body. ``limits`` maps each op the caller accepts to its largest
    body; anything else raises FrameError before a byte of body is read. The body must be
    whole ``timeout_s`` after the header, and the frame by ``deadline`` (monotonic), if given.
    With ``idle_ok`` a kernel timeout before any byte raises Idle."""
    header = recv_exact(sock, HEADER.size, idle_ok=idle_ok, deadline=deadline)
    end = time.monotonic() + timeout_s
    end = end if deadline is None else min(end, deadline)
    op, batch_id, body_len = HEADER.unpack(header)
    limit = limits.get(op)
    if limit is None:
        expected = "/".join(OP_NAMES[o] for o in limits)
        raise FrameError("unexpected frame", f"op {op} where {expected} was expected")
    if body_len > limit:
        raise FrameError("oversized frame",
                         f"{OP_NAMES[op]} body of {body_len} bytes exceeds its {limit}-byte limit")
    return op, batch_id, recv_exact(sock, body_len, deadline=end) if body_len else b""


def recv_frames(
    sock: socket.socket, limits: Mapping[int, int], timeout_s: float,
    idle_timeout_s: float | None = None,
) -> Iterator[tuple[int, int, bytes]]:
    """Frames until the connection fails (the error propagates); quiet spells are skipped
    unless one lasts ``idle_timeout_s``, which raises IdleTimeout."""
    last_s = time.monotonic()
    while True:
        try:
            frame = recv_frame(sock, limits, timeout_s, idle_ok=True)
        except Idle:
            if idle_timeout_s is not None and time.monotonic() - last_s > idle_timeout_s:
                raise IdleTimeout(f"no frame for {idle_timeout_s:.0f} s") from None
            continue
        last_s = time.monotonic()
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


def recv_exact(
    sock: socket.socket, num_bytes: int, *, idle_ok: bool = False, deadline: float | None = None
) -> bytes:
    """``num_bytes`` bytes; memory grows with what arrived, never ahead of it. Before
    ``deadline`` (monotonic) each wait is bounded by what is left of it as well."""
    chunks: list[bytes] = []
    got = 0
    while got < num_bytes:
        if deadline is not None:
            _wait_readable(sock, deadline)
        try:
            chunk = sock.recv(min(num_bytes - got, _RECV_CHUNK_BYTES))
        except (TimeoutError, BlockingIOError):
            if idle_ok and got == 0:
                raise Idle() from None
            raise TimeoutError("peer stalled in the middle of a frame") from None
        if not chunk:
            raise ConnectionError("peer closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _wait_readable(sock: socket.socket, deadline: float) -> None:
    left_s = deadline - time.monotonic()
    poller = select.poll()  # not select(): an engine's fds may pass FD_SETSIZE
    poller.register(sock, select.POLLIN)
    if left_s <= 0 or not poller.poll(left_s * 1000):
        raise TimeoutError("frame not complete before its deadline")


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
    _iov_loop(sock, iov, _libc.sendmsg, socket.MSG_NOSIGNAL, SEND_WINDOW_BYTES)


def recv_payload(sock: socket.socket, iov: np.ndarray) -> None:
    """Fill every (addr, length) run in order; MSG_WAITALL fills a window per call."""
    _iov_loop(sock, iov, _libc.recvmsg, socket.MSG_WAITALL, RECV_WINDOW_BYTES)


def split_rows(iov: np.ndarray, max_bytes: int) -> np.ndarray:
    """``iov`` with every run longer than ``max_bytes`` cut into consecutive runs of at
    most ``max_bytes`` (same bytes, same order), as a uint64 array of struct iovec rows."""
    iov = np.ascontiguousarray(iov, dtype=np.uint64).reshape(-1, 2)
    lengths = iov[:, 1]
    parts = np.maximum((lengths + (max_bytes - 1)) // max_bytes, 1).astype(np.int64)
    if len(iov) == 0 or parts.max() == 1:
        return iov.copy()
    row = np.repeat(np.arange(len(iov)), parts)
    offset = (np.arange(len(row)) - np.repeat(np.cumsum(parts) - parts, parts)).astype(np.uint64)
    offset *= np.uint64(max_bytes)
    return np.stack([iov[row, 0] + offset,
                     np.minimum(np.uint64(max_bytes), iov[row, 1] - offset)], axis=1)


def _windows(lengths: np.ndarray, max_bytes: int) -> np.ndarray:
    """Row index where each window starts (plus the end): consecutive rows, at most
    WINDOW_IOVECS of them and ``max_bytes`` in all (rows were split to fit one)."""
    ends = np.cumsum(lengths, dtype=np.int64)
    starts, i, n = [0], 0, len(lengths)
    while i < n:
        limit = (int(ends[i - 1]) if i else 0) + max_bytes
        j = int(np.searchsorted(ends, limit, side="right"))
        i = min(max(j, i + 1), i + WINDOW_IOVECS, n)
        starts.append(i)
    return np.asarray(starts, dtype=np.int64)


def merge_adjacent(iov: np.ndarray) -> np.ndarray:
    """``iov`` with each row that starts where the previous one ends folded into it. The
    payload is one byte stream, so each side merges its own runs: a write whose items
    are contiguous only on the receiving side (heads gathered from several ranks into
    one token) is sent from many runs and received into few."""
    iov = np.asarray(iov).reshape(-1, 2)
    if len(iov) <= 1:
        return iov
    joins = iov[1:, 0] == iov[:-1, 0] + iov[:-1, 1]
    if not joins.any():
        return iov
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = iov[starts].copy()
    merged[:, 1] = np.add.reduceat(iov[:, 1], starts)
    return merged


def _iov_loop(sock: socket.socket, iov: np.ndarray, call, flags: int, max_bytes: int) -> None:
    iov = split_rows(merge_adjacent(iov), max_bytes)  # struct iovec rows; a fresh array
    bounds = _windows(iov[:, 1], max_bytes)
    ends = np.cumsum(iov[:, 1], dtype=np.int64)
    window_bytes = np.diff(np.concatenate(([0], ends[bounds[1:] - 1]))).tolist()
    bounds = bounds.tolist()
    hdr = _MsgHdr()
    base, n = iov.ctypes.data, len(iov)
    i, window, left = 0, 0, window_bytes[0] if n else 0  # left: bytes of the window to go
    while i < n:
        hdr.msg_iov, hdr.msg_iovlen = base + 16 * i, bounds[window + 1] - i
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
        if done == left:  # the usual case: the whole (rest of the) window moved
            window += 1
            i = bounds[window]
            left = window_bytes[window] if i < n else 0
            continue
        left -= done
        while done:  # a short call: skip the rows it finished, trim the one it cut
            row_left = int(iov[i, 1])
            if done >= row_left:
                done -= row_left
                i += 1
            else:
                iov[i, 0] += done
                iov[i, 1] -= done
                done = 0
