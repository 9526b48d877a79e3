"""Few large segments for many small pieces: staging on our side, landing on the peer's.

Mooncake's TCP protocol acknowledges every segment (20-30 us each on loopback), so a
batch of thousands of 32 KiB pieces moved at a third of a socket's rate. Such a batch
moves chunk by chunk (``SLOT_BYTES`` at most) through a packed buffer on the side, or
the sides, where its pieces are scattered:

  staging   ours, one per peer: a write gathers a chunk's pieces into it before its
            segments, a read scatters them out of it after.
  landing   the peer's, lent to our connection on request (OP_LAND) from a pool of at
            most ``MAX_LANDINGS`` buffers of ``NUM_SLOTS`` slots: a write's segments
            land in a slot and the peer scatters them into place on OP_SCATTER; a read
            asks the peer to gather them into a slot first (OP_GATHER). With two slots
            a write's next chunk moves while the peer scatters the last one.

A chunk's segments are the runs where both sides' addresses, packed or not, continue
each other: one segment where both sides are packed or already contiguous.

Invariants: a landing buffer is lent only to an authenticated connection and only
until it closes; it stays registered and is lent again only ``quarantine_s`` after
(a write still in flight from a dead peer lands in memory nobody reads); the peer
copies only between its landing buffer and its registered regions, both checked.
"""

from __future__ import annotations

import ctypes
import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from pdserve.engine.kv_transfer.transport.base import coalesce
from pdserve.engine.kv_transfer.transport.channel_transport import Batch

SLOT_BYTES = 8 << 20  # a chunk: our staging buffer, one landing slot
NUM_SLOTS = 2
MAX_LANDINGS = 4  # landing buffers one engine lends at once (64 MiB at most)
_MIN_PIECES = 64  # fewer move as they are
_MIN_ROW_BYTES = 8  # a common unit below this copies piece by piece


@dataclass(frozen=True)
class Chunk:
    local: np.ndarray
    remote: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray  # each piece's place in the packed chunk

    @property
    def num_bytes(self) -> int:
        return int(self.lengths.sum())


@dataclass(frozen=True)
class ChunkPlan:
    """How a batch moves: its pieces in the order chunks take them, and which side packs."""

    batch: Batch  # reordered
    stage: bool  # our side through our staging buffer
    land: bool  # the peer's side through its landing buffer

    def chunks(self) -> Iterator[Chunk]:
        local, remote, lengths = self.batch.local, self.batch.remote, self.batch.lengths
        ends = np.cumsum(lengths)
        start, n = 0, len(lengths)
        while start < n:
            done = int(ends[start - 1]) if start else 0
            stop = max(start + 1, int(np.searchsorted(ends, done + SLOT_BYTES, side="right")))
            yield Chunk(local[start:stop], remote[start:stop], lengths[start:stop],
                        ends[start:stop] - lengths[start:stop] - done)
            start = stop

    def without_landing(self) -> ChunkPlan:
        return replace(self, land=False)


def chunk_plan(batch: Batch) -> ChunkPlan | None:
    """A ``ChunkPlan`` where packing pays: at least 64 pieces, each within a quarter of a
    slot, that are at least four times as many as their runs on one side at most (that
    side then moves as runs, the other packed; both packed where neither is); None
    where the pieces are few or large (each then moves as its own segment)."""
    local, remote, lengths = batch.local, batch.remote, batch.lengths
    n = len(lengths)
    if n < _MIN_PIECES or int(lengths.max()) > SLOT_BYTES // 4:
        return None
    by_remote = np.argsort(remote, kind="stable")
    if len(_run_heads(remote[by_remote], lengths[by_remote])) * 4 <= n:
        return ChunkPlan(_reordered(batch, by_remote), stage=True, land=False)
    by_local = np.argsort(local, kind="stable")
    if len(_run_heads(local[by_local], lengths[by_local])) * 4 <= n:
        return ChunkPlan(_reordered(batch, by_local), stage=False, land=True)
    return ChunkPlan(batch, stage=True, land=True)


def segments(local: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    """(local, remote, length) rows, one per run that continues on both sides."""
    return coalesce(np.stack([local, remote, lengths], axis=1)).tolist()


def copy_packed(packed: int, addrs: np.ndarray, lengths: np.ndarray,
                regions: list[tuple[int, int]], *, into_pieces: bool) -> None:
    """Copy between the packed bytes at ``packed`` (pieces back to back) and the pieces
    at ``addrs``, one row copy per piece in numpy where the pieces share a region and a
    unit of their offsets and lengths, else one ``memmove`` each."""
    total = int(lengths.sum())
    if not total:
        return
    low, high = int(addrs.min()), int((addrs + lengths).max())
    region = next(((b, size) for b, size in regions if b <= low and high <= b + size), None)
    unit = 0 if region is None else int(np.gcd.reduce(np.concatenate([lengths, addrs - region[0]])))
    if unit < _MIN_ROW_BYTES:
        offsets = (np.cumsum(lengths) - lengths + packed).tolist()
        for at, addr, n in zip(offsets, addrs.tolist(), lengths.tolist(), strict=True):
            src, dst = (at, addr) if into_pieces else (addr, at)
            ctypes.memmove(dst, src, n)
        return
    base, size = region
    rows_of = _memory(base, size - size % unit).reshape(-1, unit)
    counts = lengths // unit
    steps = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    rows = np.repeat((addrs - base) // unit, counts) + steps
    view = _memory(packed, total).reshape(-1, unit)
    if into_pieces:
        rows_of[rows] = view
    else:
        # mode "clip": the rows are inside the region by construction, and the default
        # ("raise") buffers ``out``, a second copy (4x slower for 32 KiB rows)
        np.take(rows_of, rows, axis=0, out=view, mode="clip")


def copy_pieces(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray,
                src_regions: list[tuple[int, int]], dst_regions: list[tuple[int, int]]) -> None:
    """Copy every piece ``src[i] -> dst[i]`` (``lengths[i]`` bytes) in one process: run by
    run of the side whose pieces are at least four times fewer runs (``copy_packed``,
    a numpy row copy per run), else one ``memmove`` per piece."""
    n = len(lengths)
    for packed_side, pieces, regions, into_pieces in ((src, dst, dst_regions, True),
                                                     (dst, src, src_regions, False)):
        order = np.argsort(packed_side, kind="stable")
        ordered = packed_side[order]
        heads = _run_heads(ordered, lengths[order])
        if n >= _MIN_PIECES and len(heads) * 4 <= n:
            bounds = [*heads.tolist(), n]
            for start, stop in itertools.pairwise(bounds):
                run = order[start:stop]
                copy_packed(int(ordered[start]), pieces[run], lengths[run], regions,
                            into_pieces=into_pieces)
            return
    for s, d, size in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
        ctypes.memmove(d, s, size)


@dataclass
class _Loan:
    buffer: np.ndarray
    sock: socket.socket | None
    free_since: float


class Landings:
    """The landing buffers this transport lends to connected peers (the server side)."""

    def __init__(self, register: Callable[[np.ndarray], None], quarantine_s: float,
                 max_count: int = MAX_LANDINGS) -> None:
        """``register(buffer)`` makes a new buffer reachable by peers (Mooncake's
        register_memory); buffers are created on demand, up to ``max_count``."""
        self._register, self._quarantine_s, self.max_count = register, quarantine_s, max_count
        self._loans: list[_Loan] = []
        self._lock = threading.Lock()

    @property
    def buffers(self) -> list[np.ndarray]:
        with self._lock:
            return [loan.buffer for loan in self._loans]

    def lend(self, sock: socket.socket) -> np.ndarray | None:
        """This connection's buffer (lent now if it has none); None when every buffer is
        lent or quarantined."""
        now = time.monotonic()
        with self._lock:
            mine = next((loan for loan in self._loans if loan.sock is sock), None)
            if mine is None:
                mine = next((loan for loan in self._loans if loan.sock is None
                             and now - loan.free_since >= self._quarantine_s), None)
            if mine is None and len(self._loans) < self.max_count:
                buffer = np.empty(NUM_SLOTS * SLOT_BYTES, dtype=np.uint8)
                self._register(buffer)
                mine = _Loan(buffer, None, now)
                self._loans.append(mine)
            if mine is not None:
                mine.sock = sock
            return None if mine is None else mine.buffer

    def of(self, sock: socket.socket) -> np.ndarray | None:
        with self._lock:
            return next((loan.buffer for loan in self._loans if loan.sock is sock), None)

    def give_back(self, sock: socket.socket) -> None:
        """The connection closed: its buffer rests for ``quarantine_s``, then may be lent."""
        with self._lock:
            for loan in self._loans:
                if loan.sock is sock:
                    loan.sock, loan.free_since = None, time.monotonic()


def _run_heads(addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Where each run of pieces that continue each other starts."""
    return np.flatnonzero(np.concatenate(([True], addrs[1:] != addrs[:-1] + lengths[:-1])))


def _reordered(batch: Batch, order: np.ndarray) -> Batch:
    return Batch(batch.local[order], batch.remote[order], batch.lengths[order], batch.is_write)


def _memory(addr: int, size: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))
