"""Mooncake Transfer Engine transport (RDMA in production, its TCP protocol elsewhere).

Wraps ``mooncake.engine.TransferEngine`` in P2PHANDSHAKE mode (no metadata server):
each side's Mooncake session is "host:rpc_port". Our endpoint is the channel's
address; the peer's Mooncake session id and registered regions come from its
WELCOME reply, which also authenticates us. Notifications travel on the channel,
since Mooncake's own notify needs its metadata service.

``protocol`` is "tcp" (the default; no NIC needed) or "rdma", over ``device_names``
(comma-separated, e.g. "mlx5_0,mlx5_1"; empty: every RDMA device of the host). RDMA
is refused at start, with the reason, on a host without RDMA devices or without a
named one.

How a batch moves: each KV region is registered once, at engine start; the batch's
items arrive coalesced (a contiguous run is one item, however many blocks it spans),
and each item is submitted as its own one-segment Mooncake batch, up to
``MAX_IN_FLIGHT`` outstanding (Mooncake's TCP lanes reject segments beyond their
queue, and a rejected one never completes), awaited in order on the per-peer sender
thread. Why not one Mooncake batch
for all items: the binding's only whole-batch wait, ``get_batch_transfer_status``,
busy-spins a core until the batch ends, the core the receiver needs on a small host
(one batch of 2,048 pieces: 0.5 GiB/s on loopback; 2,048 one-segment batches polled
with sleeps: 0.9 GiB/s), while ``transfer_check_status`` is exact for a batch of one
segment and returns at once. Each wait ends at our deadline at the latest; Mooncake's
own (MC_TRANSFER_TIMEOUT, at least 5 s) can outlast it, and a late result is ignored.

Many small pieces that are few runs on the peer's side (a KV re-laid out between
engines that split the heads differently: two 256-byte pieces per token, one run per
block) go through a per-peer staging buffer (``STAGING_BYTES``, registered once), one
segment per run, chunk by chunk (``staging_plan``): a write gathers its pieces into it
first, a read scatters them out of it after. Mooncake's TCP protocol costs about 20 us
per segment, which made such a transfer take seconds.

Invariants: remote ranges are checked against the peer's advertised regions before
submission (Mooncake also refuses them server-side); the process environment gets
MC_FORCE_TCP=1 for protocol "tcp" and MC_TRANSFER_TIMEOUT unless already set.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import math
import os
import socket
import threading
from dataclasses import dataclass

import numpy as np

from pdserve.engine.kv_transfer.transport.base import (
    RDMA_DEVICE_DIR,
    BatchHandle,
    Regions,
    TransportUnavailable,
    poll_while,
    rdma_devices,
)
from pdserve.engine.kv_transfer.transport.channel_transport import Batch, ChannelTransport
from pdserve.engine.kv_transfer.transport.limits import ChannelLimits
from pdserve.engine.kv_transfer.transport.link import PeerLink

_MIN_MOONCAKE_TIMEOUT_S = 5
# Segments submitted and not yet done, per batch. Mooncake's TCP protocol queues them per
# lane and rejects what does not fit (a push of 4,096 blocks at once never finished).
MAX_IN_FLIGHT = 256
STAGING_BYTES = 8 << 20  # per peer (StagingPlan)
PROTOCOLS = ("tcp", "rdma")


class MooncakeTransport(ChannelTransport):
    name = "mooncake"
    finishes_empty_batches = True  # Mooncake is never handed a batch with nothing to move

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        protocol: str = "tcp",
        device_names: str = "",
        auth_token: str | None = None,
        timeout_s: float = 10.0,
        limits: ChannelLimits | None = None,
    ) -> None:
        """Raises ValueError for an unknown protocol, RuntimeError when RDMA cannot run here."""
        check_protocol(protocol, device_names)
        if protocol == "tcp":
            os.environ.setdefault("MC_FORCE_TCP", "1")
        os.environ.setdefault(
            "MC_TRANSFER_TIMEOUT", str(max(_MIN_MOONCAKE_TIMEOUT_S, math.ceil(timeout_s)))
        )
        from mooncake.engine import TransferEngine  # imported late: env must be set first

        self._engine = TransferEngine()
        mc_host = advertise_host or host
        rc = self._engine.initialize(mc_host, "P2PHANDSHAKE", protocol, device_names)
        if rc != 0:
            raise TransportUnavailable(f"Mooncake initialize({mc_host}, P2PHANDSHAKE, {protocol}) = {rc}")
        self.session_id = f"{mc_host}:{self._engine.get_rpc_port()}"
        self._staging: dict[str, np.ndarray] = {}
        self._staging_lock = threading.Lock()
        super().__init__(host=host, port=port, advertise_host=advertise_host,
                         auth_token=auth_token, timeout_s=timeout_s, limits=limits)

    def register_memory(self, ptr: int, length: int) -> None:
        rc = self._engine.register_memory(ptr, length)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory({ptr:#x}, {length}) = {rc}")
        super().register_memory(ptr, length)

    def close(self) -> None:
        super().close()
        for ptr, _ in self._regions.as_list():
            self._engine.unregister_memory(ptr)
        self._regions = Regions()
        with self._staging_lock:
            for buffer in self._staging.values():
                self._engine.unregister_memory(buffer.ctypes.data)
            self._staging.clear()

    def _welcome(self) -> dict:
        return {**super()._welcome(), "session": self.session_id}

    def _move(self, link: PeerLink, sock: socket.socket, handle: BatchHandle, batch: Batch) -> None:
        """Submit the batch as single-segment Mooncake batches and wait for each in turn
        (see the module docstring); many small pieces that are few runs on the peer's
        side go through a staging buffer (``staging_plan``)."""
        engine, session = self._engine, link.info["session"]
        submit = (engine.batch_transfer_async_write if batch.is_write
                  else engine.batch_transfer_async_read)
        plan = staging_plan(batch, self._regions.as_list())
        if plan is None:
            rows = zip(batch.local.tolist(), batch.remote.tolist(), batch.lengths.tolist(), strict=True)
            if self._run_segments(handle, submit, session, rows):
                handle.finish()
            return
        staging = self._staging_for(link.peer)
        for rows in plan.chunks(staging):
            if not self._run_segments(handle, submit, session, rows):
                return
        handle.finish()

    def _run_segments(self, handle: BatchHandle, submit, session: str, rows) -> bool:
        """Move every (local, remote, length) row as its own segment, at most
        ``MAX_IN_FLIGHT`` outstanding; False once ``handle`` failed (or its deadline passed)."""
        engine, rows = self._engine, iter(rows)
        in_flight: collections.deque[int] = collections.deque()
        while True:
            for local, remote, length in itertools.islice(rows, MAX_IN_FLIGHT - len(in_flight)):
                batch_id = submit(session, [local], [remote], [length])
                if batch_id <= 0:
                    handle.fail(f"Mooncake refused to submit the batch ({batch_id})")
                    return False
                in_flight.append(batch_id)
            if not in_flight:
                return True
            batch_id, status = in_flight.popleft(), 0

            def is_pending(batch_id=batch_id) -> bool:
                nonlocal status
                status = engine.transfer_check_status(batch_id)  # 0 pending, 1 done, <0 failed
                return status == 0

            poll_while(is_pending, handle)
            if status < 0:
                handle.fail(f"Mooncake batch to {session} failed (status {status})")
                return False
            if status == 0:
                return False  # the deadline passed: the handle says so

    def _staging_for(self, peer: str) -> np.ndarray:
        """This peer's staging buffer (its sender thread is the only user), registered
        with Mooncake on first use and released at close."""
        with self._staging_lock:
            buffer = self._staging.get(peer)
            if buffer is None:
                buffer = np.empty(STAGING_BYTES, dtype=np.uint8)
                rc = self._engine.register_memory(buffer.ctypes.data, buffer.nbytes)
                if rc != 0:
                    raise RuntimeError(f"Mooncake register_memory(staging) = {rc}")
                self._staging[peer] = buffer
            return buffer


@dataclass
class StagingPlan:
    """A batch of many small pieces, scattered in our memory, whose peer side is few
    runs: each run moves as one segment through a staging buffer, chunk by chunk. A
    write copies its pieces, in order, into the buffer first (a KV re-laid out for a
    peer that splits the heads differently: two 256-byte pieces per token from two
    ranks, one run per block of the peer); a read, sorted by peer address, fetches the
    peer's runs into the buffer and then copies each piece to its place."""

    batch: Batch
    region: tuple[int, int]  # the registered region every local piece lies in
    unit: int  # every local piece's offset in it, and its length, are multiples of this
    order: np.ndarray | None  # reads: the pieces sorted by peer address

    def chunks(self, staging: np.ndarray):
        """Yield each chunk's segments (staging address, peer run, length); a write's
        pieces are in ``staging`` when they are yielded, a read's are copied out of it
        when the caller asks for the next chunk (after the segments landed)."""
        local, remote, lengths = self.batch.local, self.batch.remote, self.batch.lengths
        if self.order is not None:
            local, remote, lengths = local[self.order], remote[self.order], lengths[self.order]
        base, size = self.region
        unit = self.unit
        memory = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(base))
        rows_of = memory[:size - size % unit].reshape(-1, unit)
        ends = np.cumsum(lengths)
        start, n = 0, len(lengths)
        while start < n:
            done = int(ends[start - 1]) if start else 0
            stop = max(start + 1, int(np.searchsorted(ends, done + staging.nbytes, side="right")))
            counts = lengths[start:stop] // unit
            steps = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            rows = np.repeat((local[start:stop] - base) // unit, counts) + steps
            view = staging[:len(rows) * unit].reshape(-1, unit)
            if self.batch.is_write:
                np.take(rows_of, rows, axis=0, out=view)
            offsets = ends[start:stop] - lengths[start:stop] - done
            joins = remote[start + 1:stop] == remote[start:stop - 1] + lengths[start:stop - 1]
            heads = np.flatnonzero(np.concatenate(([True], ~joins)))
            runs = np.add.reduceat(lengths[start:stop], heads)
            yield zip((staging.ctypes.data + offsets[heads]).tolist(),
                      remote[start:stop][heads].tolist(), runs.tolist(), strict=True)
            if not self.batch.is_write:
                rows_of[rows] = view
            start = stop


def staging_plan(batch: Batch, regions: list[tuple[int, int]]) -> StagingPlan | None:
    """A ``StagingPlan`` for ``batch`` where it pays: its pieces are at most a quarter as
    many runs on the peer's side, each fits a quarter of the staging buffer, and they
    lie in one of our regions at offsets of a common unit of at least 64 bytes; None
    otherwise (each piece is then its own segment)."""
    local, remote, lengths = batch.local, batch.remote, batch.lengths
    if len(lengths) < 64 or int(lengths.max()) > STAGING_BYTES // 4:
        return None
    order = None if batch.is_write else np.argsort(remote, kind="stable")
    r, n = (remote, lengths) if order is None else (remote[order], lengths[order])
    runs = 1 + int(np.count_nonzero(r[1:] != r[:-1] + n[:-1]))
    if runs * 4 > len(lengths):
        return None
    low, high = int(local.min()), int((local + lengths).max())
    region = next(((b, size) for b, size in regions if b <= low and high <= b + size), None)
    if region is None:
        return None
    unit = int(np.gcd.reduce(np.concatenate([lengths, local - region[0]])))
    return StagingPlan(batch, region, unit, order) if unit >= 64 else None


def check_protocol(protocol: str, device_names: str) -> None:
    """Refuse, before Mooncake starts, what it cannot run here: an unknown protocol, RDMA
    on a host without RDMA devices, or an RDMA device this host does not have."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"Mooncake protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if protocol != "rdma":
        return
    present = rdma_devices()
    if not present:
        raise TransportUnavailable(
            f"Mooncake protocol rdma needs an RDMA NIC, and this host has none "
            f"({RDMA_DEVICE_DIR} is empty or missing); use protocol tcp")
    missing = [d for d in device_names.split(",") if d.strip() and d.strip() not in present]
    if missing:
        raise TransportUnavailable(
            f"RDMA device(s) {', '.join(missing)} not found on this host (it has "
            f"{', '.join(present)})")
