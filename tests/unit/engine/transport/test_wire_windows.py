"""Payload windows (wire.py): a contiguous run is received in byte-bounded windows.

A loopback TCP connection carries real payloads; a recording stand-in for libc's ``recvmsg`` counts
what each call was asked for, then makes the real call.
"""

from __future__ import annotations

import ctypes
import socket
import threading

import numpy as np
import pytest
import torch

from pdserve.engine.kv_transfer.transport import wire

MIB = 1 << 20


def test_split_rows_cuts_long_runs_and_keeps_bytes_in_order():
    iov = np.array([[1000, 5], [5000, 2 * MIB + 3], [9 * MIB, MIB]], dtype=np.uint64)
    rows = wire.split_rows(iov, MIB)
    assert rows.tolist() == [
        [1000, 5],
        [5000, MIB], [5000 + MIB, MIB], [5000 + 2 * MIB, 3],
        [9 * MIB, MIB],
    ]
    assert wire.split_rows(iov[:1], MIB).tolist() == [[1000, 5]]  # nothing to cut


def test_runs_adjacent_on_one_side_are_merged_for_that_side_alone():
    # A token's two heads from two ranks: scattered where they are read, one run where
    # they land; each side of the stream merges its own rows.
    landing = np.array([[0, 256], [256, 256], [512, 256], [2048, 256]], dtype=np.uint64)
    assert wire.merge_adjacent(landing).tolist() == [[0, 768], [2048, 256]]
    read_from = np.array([[0, 256], [4096, 256], [256, 256]], dtype=np.uint64)
    assert wire.merge_adjacent(read_from).tolist() == read_from.tolist()


def test_windows_are_bounded_by_bytes_and_by_iovec_count():
    lengths = np.full(3000, 4096, dtype=np.uint64)  # 12 MiB of 4 KiB rows
    bounds = wire._windows(lengths, MIB)
    sizes = np.diff(bounds)
    assert bounds[0] == 0 and bounds[-1] == 3000
    assert (sizes <= MIB // 4096).all() and sizes.sum() == 3000
    many_small = wire._windows(np.full(3000, 16, dtype=np.uint64), MIB)
    assert (np.diff(many_small) <= wire.WINDOW_IOVECS).all()  # UIO_MAXIOV still holds


class RecordingLibc:
    """libc with a recvmsg that records the bytes each call was given."""

    def __init__(self) -> None:
        self.sendmsg = wire._libc.sendmsg
        self._recvmsg = wire._libc.recvmsg
        self.asked: list[int] = []

    def recvmsg(self, fd, hdr, flags):
        msg = hdr._obj
        iov = np.ctypeslib.as_array(
            (ctypes.c_uint64 * (2 * msg.msg_iovlen)).from_address(msg.msg_iov))
        self.asked.append(int(iov[1::2].sum()))
        return self._recvmsg(fd, hdr, flags)


def loopback_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    return a, b


@pytest.mark.parametrize("layout", ["contiguous", "scattered"])
def test_a_64_mib_payload_lands_byte_exact_in_bounded_windows(monkeypatch, layout):
    libc = RecordingLibc()
    monkeypatch.setattr(wire, "_libc", libc)
    total, piece = 64 * MIB, 32 << 10
    src = torch.randint(0, 256, (total,), dtype=torch.uint8)
    dst = torch.zeros(total, dtype=torch.uint8)
    order = np.arange(total // piece)
    if layout == "scattered":
        order = np.random.default_rng(0).permutation(len(order))
    offsets = order * piece
    send_iov = np.stack([src.data_ptr() + offsets, np.full(len(offsets), piece)], axis=1)
    recv_iov = np.stack([dst.data_ptr() + offsets, np.full(len(offsets), piece)], axis=1)
    if layout == "contiguous":  # what coalescing makes of it: one run of 64 MiB
        send_iov = np.array([[src.data_ptr(), total]])
        recv_iov = np.array([[dst.data_ptr(), total]])
    a, b = loopback_pair()
    for sock in (a, b):
        wire.configure(sock, 10.0)
    sender = threading.Thread(target=wire.send_payload, args=(a, send_iov))
    sender.start()
    try:
        wire.recv_payload(b, recv_iov)
    finally:
        sender.join(10)
        a.close()
        b.close()
    assert torch.equal(dst, src)
    assert max(libc.asked) <= wire.RECV_WINDOW_BYTES
    assert sum(libc.asked) >= total  # a call cut short asks again for the rest only


def test_short_calls_resume_in_the_middle_of_a_row():
    """A call may move less than its window (a signal, a send buffer filling up): the
    next call starts exactly where it stopped, even inside a row."""
    stream = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8)
    dst = np.zeros(12_000, dtype=np.uint8)
    rows = [(0, 3000), (5000, 5), (3100, 1900), (6000, 5095)]  # out of order, odd sizes
    iov = np.array([[dst.ctypes.data + off, n] for off, n in rows], dtype=np.uint64)
    moved = 0

    def short_recvmsg(fd, hdr, flags):
        nonlocal moved
        msg = hdr._obj
        table = np.ctypeslib.as_array(
            (ctypes.c_uint64 * (2 * msg.msg_iovlen)).from_address(msg.msg_iov)).reshape(-1, 2)
        budget = 777  # bytes per call, never a row boundary
        for addr, length in table.tolist():
            n = min(length, budget)
            ctypes.memmove(addr, stream[moved:].ctypes.data, n)
            moved, budget = moved + n, budget - n
            if not budget:
                break
        return 777 - budget

    class Sock:
        def fileno(self) -> int:
            return -1

    wire._iov_loop(Sock(), iov, short_recvmsg, 0, 4096)
    assert moved == 10_000
    offset = 0
    for off, n in rows:
        assert (dst[off:off + n] == stream[offset:offset + n]).all(), (off, n)
        offset += n
