"""The one KV transport interface, its value types, and helpers every transport shares.

A transport moves bytes between a local registered region and a peer's registered
region. It knows nothing about layers, blocks or requests: the KV connector turns
block tables into items (one contiguous run of bytes each), as a list of
``TransferItem`` or, for thousands of pieces, an int64 array of shape (n, 3).

Invariants every transport keeps:
- Bytes are only ever written into, or read from, memory its owner registered with
  ``register_memory``; a batch that reaches outside is FAILED with a message naming
  the range, and the peer keeps serving.
- ``write_batch``/``read_batch`` never block on the network; ``poll`` never blocks.
- Every batch ends DONE or FAILED, at the latest ``timeout_s`` after submission
  (dead or SIGSTOPped peers included). Terminal states latch: a late reply for a
  batch that already FAILED changes nothing. A FAILED write may have partly landed.
- ``notify`` to a peer is delivered after every batch submitted earlier to that peer.
"""

from __future__ import annotations

import abc
import enum
import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class TransportUnavailable(RuntimeError):
    """A transport cannot start on this host as configured (no RDMA NIC, a backend that
    does not load); the engine refuses to start with this message, without a traceback."""

class TransferItem(NamedTuple):
    """One contiguous run: ``length`` bytes at ``local_addr`` <-> ``remote_addr``."""

    local_addr: int
    remote_addr: int
    length: int


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferStatus:
    state: TransferState
    message: str = ""

    @property
    def is_pending(self) -> bool:
        return self.state is TransferState.PENDING

    @property
    def is_done(self) -> bool:
        return self.state is TransferState.DONE

    @property
    def is_failed(self) -> bool:
        return self.state is TransferState.FAILED


PENDING = TransferStatus(TransferState.PENDING)
DONE = TransferStatus(TransferState.DONE)

_batch_ids = itertools.count(1)


class BatchHandle:
    """One submitted batch. Transports finish it from their threads; ``poll`` reads it.

    The first ``finish``/``fail`` wins (terminal states latch); the deadline turns a
    silent batch into FAILED when it is polled or waited on.
    """

    def __init__(self, peer: str, num_bytes: int, timeout_s: float) -> None:
        self.batch_id = next(_batch_ids)
        self.peer = peer
        self.num_bytes = num_bytes
        self.deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._status = PENDING
        self._event = threading.Event()
        self._lock = threading.Lock()

    def finish(self) -> bool:
        """Transport threads: the batch landed. False if it had already ended."""
        return self._settle(DONE)

    def fail(self, message: str) -> bool:
        return self._settle(TransferStatus(TransferState.FAILED, message))

    def _settle(self, status: TransferStatus) -> bool:
        with self._lock:
            if not self._status.is_pending:
                return False
            self._status = status
        self._event.set()
        return True

    def status(self) -> TransferStatus:
        if self._status.is_pending and time.monotonic() >= self.deadline:
            self.fail(f"timed out after {self._timeout_s:.1f} s waiting for peer {self.peer}")
        return self._status

    def wait(self, timeout_s: float | None = None) -> TransferStatus:
        """Block until terminal (tests and benchmarks only; engines use ``poll``)."""
        limit = self.deadline - time.monotonic()
        if timeout_s is not None:
            limit = min(limit, timeout_s)
        self._event.wait(max(limit, 0.0))
        return self.status()


_POLL_FIRST_S = 20e-6  # poll_while's pause doubles from this ...
_POLL_MAX_S = 1e-3  # ... up to this: < 3% of a 64 MiB batch at loopback speed


def poll_while(is_pending: Callable[[], bool], handle: BatchHandle,
               is_stopped: Callable[[], bool] = lambda: False) -> None:
    """Transport threads: wait for a library's request that can only be polled (Mooncake,
    NIXL), sleeping between checks rather than spinning a core, until ``is_pending()``
    is False, ``handle`` has ended (its deadline) or ``is_stopped()`` (the transport closed)."""
    pause_s = _POLL_FIRST_S
    while is_pending() and handle.status().is_pending and not is_stopped():
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, _POLL_MAX_S)


class Regions:
    """Registered address ranges of one process.

    Checks are vectorized over item arrays: a 2048-piece batch must cost microseconds
    of Python, not milliseconds.
    """

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] = []

    def add(self, ptr: int, length: int) -> None:
        if ptr <= 0 or length <= 0:
            raise ValueError(f"bad region ptr={ptr:#x} length={length}")
        self._ranges.append((ptr, length))

    def as_list(self) -> list[tuple[int, int]]:
        return list(self._ranges)

    def check(self, addrs: np.ndarray, lengths: np.ndarray, *, side: str = "local",
              ranges: list | None = None) -> str | None:
        """A message naming the first [addr, +length) outside every range, or None."""
        ranges = self._ranges if ranges is None else ranges
        inside = np.zeros(len(addrs), dtype=bool)
        for base, size in ranges:
            inside |= (addrs >= base) & (addrs + lengths <= base + size)
        inside &= lengths >= 0
        if inside.all():
            return None
        bad = int(np.flatnonzero(~inside)[0])
        owner = "peer" if side == "remote" else "local"
        return (
            f"{side} range [{int(addrs[bad]):#x}, +{int(lengths[bad])}) is outside the "
            f"{owner} registered memory"
        )


Items = list[TransferItem] | np.ndarray  # an array is int64, shape (n, 3), same columns


def as_array(items: Items) -> np.ndarray:
    """Items as an int64 array of shape (n, 3): local_addr, remote_addr, length."""
    if isinstance(items, np.ndarray):
        return items.astype(np.int64, copy=False).reshape(-1, 3)
    flat = itertools.chain.from_iterable(items)  # 5x faster than np.array on tuples
    return np.fromiter(flat, dtype=np.int64, count=3 * len(items)).reshape(-1, 3)


def coalesce(items: Items) -> np.ndarray:
    """Drop empty items and merge neighbours contiguous on both sides (fewer, larger copies)."""
    arr = as_array(items)
    arr = arr[arr[:, 2] > 0]
    if len(arr) <= 1:
        return arr
    ends = arr[:-1, :2] + arr[:-1, 2:3]
    joins = (arr[1:, 0] == ends[:, 0]) & (arr[1:, 1] == ends[:, 1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = arr[starts].copy()
    merged[:, 2] = np.add.reduceat(arr[:, 2], starts)
    return merged


RDMA_DEVICE_DIR = "/sys/class/infiniband"


def rdma_devices() -> list[str]:
    """This host's RDMA devices (mlx5_0, ...), sorted; empty where there is no NIC."""
    try:
        return sorted(os.listdir(RDMA_DEVICE_DIR))
    except OSError:
        return []


class Transport(abc.ABC):
    """Moves KV bytes to and from peers. The KV connector's worker half is the caller."""

    name: str = ""

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """What a peer passes as ``peer`` to reach us ("host:port")."""

    @abc.abstractmethod
    def register_memory(self, ptr: int, length: int) -> None:
        """Called once per KV region at engine start, before peers connect."""

    @abc.abstractmethod
    def write_batch(self, peer: str, items: Items) -> BatchHandle:
        """Push local bytes into the peer's registered memory (P in push modes).

        ``items`` is a list of TransferItem or, cheaper for thousands of blocks, an
        int64 array of shape (n, 3) with the same columns.
        """

    @abc.abstractmethod
    def read_batch(self, peer: str, items: Items) -> BatchHandle:
        """Pull the peer's registered bytes into local memory (D in pull mode)."""

    def poll(self, handle: BatchHandle) -> TransferStatus:
        """Called by the connector every step; never blocks."""
        return handle.status()

    @abc.abstractmethod
    def notify(self, peer: str, message: bytes) -> None:
        """Send a small control message (e.g. DONE + first token); ordered after batches."""

    @abc.abstractmethod
    def recv_notifications(self) -> list[tuple[str, bytes, float]]:
        """Drain (peer endpoint, message, received_s) received so far; never blocks.
        ``received_s`` is the monotonic time the message came off the wire."""

    def set_notify_hook(self, hook) -> None:
        """Call ``hook()`` (no arguments, from a transport thread, must not block) each
        time a notification arrives, so an idle owner can drain them at once. Called
        once at engine start-up; transports without a receive thread ignore it."""
        return None

    def grant(self, peer: str, tag: str, ranges: np.ndarray) -> None:
        """Allow ``peer`` to write into ``ranges`` ([n, 2]: addr, length) until ``revoke(tag)``.

        Called by D's connector when it reserves blocks for a transfer. Transports that
        cannot enforce grants accept and ignore it.
        """
        return None

    def revoke(self, tag: str) -> bool:
        """End a grant. True when no write under it can land any more, so its memory
        may be reused; False when this transport cannot promise that (the caller then
        waits for the writer to confirm)."""
        return False

    @abc.abstractmethod
    def close(self) -> None:
        """Stop threads and close sockets; pending batches become FAILED. Idempotent."""
