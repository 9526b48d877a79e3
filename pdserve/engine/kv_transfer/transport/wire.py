"""Frame format and socket helpers of the transport control/data channel (no threads).

A frame is ``op:u8 | batch_id:u64 | body_len:u32`` (network order), then ``body``,
then for data-carrying ops a payload whose size the body's item table implies.
Payloads move with ``sendmsg``/``recvmsg_into`` over lists of memoryviews straight
from/into registered memory: no per-byte Python work and no intermediate copies.
"""

from __future__ import annotations

import socket
import struct

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
# Buffers handed to one sendmsg/recvmsg_into. Each call pins every buffer it is given
# while the kernel moves only what the socket buffer holds, so a short window beats
# Linux's UIO_MAXIOV (1024): fewer buffer acquisitions per partial transfer.
IOV_WINDOW = 128
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
    sock: socket.socket, op: int, batch_id: int = 0, body: bytes = b"", views=()
) -> None:
    send_views(sock, [HEADER.pack(op, batch_id, len(body)) + body, *views])


def recv_frame(sock: socket.socket, *, idle_ok: bool = False) -> tuple[int, int, bytes]:
    """Read one header and body. With ``idle_ok`` a timeout before any byte raises Idle."""
    header = recv_exact(sock, HEADER.size, idle_ok=idle_ok)
    op, batch_id, body_len = HEADER.unpack(header)
    if body_len > MAX_BODY_BYTES:
        raise ValueError(f"frame body of {body_len} bytes exceeds {MAX_BODY_BYTES}")
    return op, batch_id, recv_exact(sock, body_len) if body_len else b""


def recv_exact(sock: socket.socket, num_bytes: int, *, idle_ok: bool = False) -> bytes:
    buf = bytearray(num_bytes)
    view = memoryview(buf)
    got = 0
    while got < num_bytes:
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            if idle_ok and got == 0:
                raise Idle() from None
            raise
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n
    return bytes(buf)


def send_views(sock: socket.socket, views: list) -> None:
    """sendall over many byte buffers (memoryviews of format "B"), IOV_MAX at a time, resuming after partial sends."""
    views = [v for v in views if len(v)]
    _advance_loop(views, sock.sendmsg)


def recv_into_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view in order from the stream (scatter read)."""
    views = [v for v in views if len(v)]

    def step(chunk: list[memoryview]) -> int:
        n = sock.recvmsg_into(chunk)[0]
        if n == 0:
            raise ConnectionError("peer closed the connection mid-payload")
        return n

    _advance_loop(views, step)


def drain(sock: socket.socket, num_bytes: int) -> None:
    """Discard ``num_bytes`` of payload (a refused batch) to keep the stream in step."""
    scratch = memoryview(bytearray(min(num_bytes, _DRAIN_CHUNK_BYTES) or 1))
    while num_bytes > 0:
        n = sock.recv_into(scratch, min(num_bytes, len(scratch)))
        if n == 0:
            raise ConnectionError("peer closed the connection mid-payload")
        num_bytes -= n


def _advance_loop(views: list[memoryview], io) -> None:
    i = 0
    while i < len(views):
        done = io(views[i : i + IOV_WINDOW])
        while done and i < len(views):
            size = len(views[i])
            if done >= size:
                done -= size
                i += 1
            else:
                views[i] = views[i][done:]
                done = 0
