"""Many small pieces as few segments: which side packs, the packed copies, the landing
buffers a Mooncake peer lends, and what it answers a peer that misuses them."""

from __future__ import annotations

import ctypes
import json
import socket
import time

import numpy as np
import pytest

from pdserve.engine.kv_transfer.transport import create_transport, wire
from pdserve.engine.kv_transfer.transport.channel_transport import Batch
from pdserve.engine.kv_transfer.transport.staging import (
    SLOT_BYTES,
    Landings,
    chunk_plan,
    copy_packed,
    copy_pieces,
    segments,
)

TOKEN = "s3cret"


def batch(local, remote, piece: int, is_write: bool = True) -> Batch:
    n = len(local)
    return Batch(np.asarray(local, dtype=np.int64) * piece, np.asarray(remote, dtype=np.int64) * piece,
                 np.full(n, piece, dtype=np.int64), is_write)


def test_the_side_whose_pieces_are_scattered_is_the_one_packed():
    rng = np.random.default_rng(0)
    shuffled = rng.permutation(256)
    every_other = rng.permutation(256) * 2
    # one run there once sorted (a permutation of it): ours are packed
    plan = chunk_plan(batch(every_other, shuffled, 4096))
    assert (plan.stage, plan.land) == (True, False)
    assert np.array_equal(plan.batch.remote, np.sort(plan.batch.remote))
    # one run here once sorted: the peer's side lands packed
    plan = chunk_plan(batch(shuffled, every_other, 4096))
    assert (plan.stage, plan.land) == (False, True)
    assert np.array_equal(plan.batch.local, np.sort(plan.batch.local))
    # scattered on both sides: both packed
    assert (lambda p: (p.stage, p.land))(chunk_plan(batch(every_other, every_other[::-1], 4096))) \
        == (True, True)
    # a few pieces, or large ones, move as they are
    assert chunk_plan(batch(every_other[:63], shuffled[:63], 4096)) is None
    assert chunk_plan(batch(every_other, shuffled, SLOT_BYTES // 2)) is None


def test_chunks_fill_a_slot_at_most_with_their_pieces_packed_in_order():
    plan = chunk_plan(batch(np.arange(1000) * 3, np.arange(1000) * 2, 48 << 10))
    chunks = list(plan.chunks())
    assert sum(len(c.lengths) for c in chunks) == 1000
    for chunk in chunks:
        assert chunk.num_bytes <= SLOT_BYTES
        assert np.array_equal(chunk.offsets, np.cumsum(chunk.lengths) - chunk.lengths)
    assert chunks[0].num_bytes == SLOT_BYTES - SLOT_BYTES % (48 << 10)


def test_segments_are_the_runs_that_continue_on_both_sides():
    local = np.array([0, 10, 20, 40, 50], dtype=np.int64)
    remote = np.array([100, 110, 200, 210, 220], dtype=np.int64)
    lengths = np.full(5, 10, dtype=np.int64)
    assert segments(local, remote, lengths) == [[0, 100, 20], [20, 200, 10], [40, 210, 20]]


@pytest.mark.parametrize("piece", [64, 3])  # in rows of a common unit; piece by piece
def test_packed_copies_gather_and_scatter_byte_exact(piece):
    region = np.random.default_rng(1).integers(0, 255, 1 << 16, dtype=np.uint8)
    base = region.ctypes.data
    picks = np.random.default_rng(2).permutation(len(region) // piece)[:200]
    addrs, lengths = base + picks * piece, np.full(200, piece, dtype=np.int64)
    packed = np.zeros(200 * piece, dtype=np.uint8)
    copy_packed(packed.ctypes.data, addrs, lengths, [(base, region.nbytes)], into_pieces=False)
    expected = np.concatenate([region[p * piece:(p + 1) * piece] for p in picks])
    assert np.array_equal(packed, expected)
    region[:] = 0
    copy_packed(packed.ctypes.data, addrs, lengths, [(base, region.nbytes)], into_pieces=True)
    assert np.array_equal(np.concatenate([region[p * piece:(p + 1) * piece] for p in picks]), expected)
    assert int(region.astype(np.int64).sum()) == int(expected.astype(np.int64).sum())


@pytest.mark.parametrize("packed", ["source", "destination", "neither"])
def test_pieces_copy_in_one_process_whichever_side_is_one_run(packed):
    piece, n = 256, 128
    rng = np.random.default_rng(3)
    a = rng.integers(0, 255, 4 * n * piece, dtype=np.uint8)
    b = np.zeros_like(a)
    spots = [np.arange(n), rng.permutation(2 * n)[:n] * 2]
    src_at = spots[0] if packed == "source" else spots[1]
    dst_at = spots[0] if packed == "destination" else rng.permutation(2 * n)[:n] * 2
    src, dst = a.ctypes.data + src_at * piece, b.ctypes.data + dst_at * piece
    copy_pieces(src, dst, np.full(n, piece, dtype=np.int64), [(a.ctypes.data, a.nbytes)],
                [(b.ctypes.data, b.nbytes)])
    for i, j in zip(src_at.tolist(), dst_at.tolist(), strict=True):
        assert np.array_equal(b[j * piece:(j + 1) * piece], a[i * piece:(i + 1) * piece])
    assert np.count_nonzero(b.reshape(-1, piece).any(axis=1)) <= n


def test_landing_buffers_are_lent_per_connection_up_to_the_cap_and_rest_before_reuse():
    registered = []
    landings = Landings(registered.append, quarantine_s=0.2, max_count=2)
    a, b, c = (socket.socket() for _ in range(3))
    try:
        first = landings.lend(a)
        assert landings.lend(a) is first and landings.of(a) is first
        second = landings.lend(b)
        assert second is not first and landings.lend(c) is None  # the cap
        assert registered == [first, second]
        landings.give_back(a)
        assert landings.of(a) is None and landings.lend(c) is None  # resting
        time.sleep(0.25)
        assert landings.lend(c) is first and len(registered) == 2  # reused, not new
    finally:
        for sock in (a, b, c):
            sock.close()


class Raw:
    """An authenticated connection to a transport's channel, speaking frames by hand."""

    def __init__(self, endpoint: str) -> None:
        host, _, port = endpoint.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=5)
        hello = json.dumps({"token": TOKEN, "endpoint": "127.0.0.1:1"}).encode()
        wire.send_frame(self.sock, wire.OP_HELLO, 0, hello)
        op, _, self.info = self.frame()
        assert op == wire.OP_WELCOME

    def frame(self) -> tuple[int, int, bytes]:
        header = self._exact(wire.HEADER.size)
        op, batch_id, length = wire.HEADER.unpack(header)
        return op, batch_id, self._exact(length)

    def ask(self, op: int, body: bytes = b"") -> tuple[int, bytes]:
        wire.send_frame(self.sock, op, 7, body)
        reply_op, batch_id, reply = self.frame()
        assert batch_id == 7
        return reply_op, reply

    def _exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            assert chunk, "the peer closed the connection"
            data += chunk
        return data


def table(offset: int, addrs, lengths) -> bytes:
    return offset.to_bytes(8, "little") + wire.encode_table(np.asarray(addrs, dtype=np.int64),
                                                            np.asarray(lengths, dtype=np.int64))


def test_a_mooncake_peer_refuses_landing_misuse_and_keeps_serving():
    transport = create_transport("mooncake", auth_token=TOKEN, timeout_s=2.0)
    kv = np.zeros(1 << 16, dtype=np.uint8)
    transport.register_memory(kv.ctypes.data, kv.nbytes)
    raw = Raw(transport.endpoint)
    try:
        base = kv.ctypes.data
        op, reason = raw.ask(wire.OP_SCATTER, table(0, [base], [64]))
        assert op == wire.OP_NACK and b"no landing buffer" in reason
        op, body = raw.ask(wire.OP_LAND)
        assert op == wire.OP_LANDING
        landing = json.loads(body)["addr"]
        op, reason = raw.ask(wire.OP_SCATTER, table(0, [base + kv.nbytes - 32], [64]))
        assert op == wire.OP_NACK and b"outside the peer registered memory" in reason
        op, reason = raw.ask(wire.OP_GATHER, table(2 * SLOT_BYTES - 32, [base], [64]))
        assert op == wire.OP_NACK and b"overflow the landing buffer" in reason
        # still serving: bytes put in the landing buffer (as a Mooncake write would) land
        ctypes.memset(landing, 0xAB, 128)
        op, _ = raw.ask(wire.OP_SCATTER, table(0, [base + 640, base + 64], [64, 64]))
        assert op == wire.OP_ACK
        assert kv[64:128].tolist() == [0xAB] * 64 and kv[640:704].tolist() == [0xAB] * 64
        assert not kv[128:640].any()
    finally:
        raw.sock.close()
        transport.close()
