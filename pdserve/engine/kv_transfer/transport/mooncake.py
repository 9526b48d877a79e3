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

Many small pieces (a KV scattered over D's blocks, or re-laid out between engines that
split the heads differently) move chunk by chunk as few large segments (staging.py):
packed into our staging buffer where they are scattered here, landing packed in a
buffer the peer lends our connection where they are scattered there, which the peer
then scatters into place (or gathers from, for a read) on a channel message. Mooncake's
TCP protocol costs 20-30 us per segment, which made 2,048 scattered 32 KiB pieces move
at a third of a socket's rate, and a re-laid out transfer take seconds.

Invariants: remote ranges are checked against the peer's advertised regions before
submission (Mooncake also refuses them server-side); the process environment gets
MC_FORCE_TCP=1 for protocol "tcp" and MC_TRANSFER_TIMEOUT unless already set.
"""

from __future__ import annotations

import collections
import json
import math
import os
import socket
import threading
import time

import numpy as np

from pdserve.engine.kv_transfer.transport import wire
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
from pdserve.engine.kv_transfer.transport.staging import (
    NUM_SLOTS,
    SLOT_BYTES,
    Chunk,
    ChunkPlan,
    Landings,
    chunk_plan,
    copy_packed,
    segments,
)
from pdserve.runtime.extras import install_command

_MIN_MOONCAKE_TIMEOUT_S = 5
# Segments submitted and not yet done, per batch. Mooncake's TCP protocol queues them per
# lane and rejects what does not fit (a push of 4,096 blocks at once never finished).
MAX_IN_FLIGHT = 256
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
        try:
            from mooncake.engine import TransferEngine  # imported late: env must be set first
        except ImportError as exc:
            raise TransportUnavailable(
                f"the mooncake transport needs the Mooncake transfer engine ({exc}): "
                f"{install_command('mooncake')}, or choose transport tcp") from None

        self._engine = TransferEngine()
        mc_host = advertise_host or host
        rc = self._engine.initialize(mc_host, "P2PHANDSHAKE", protocol, device_names)
        if rc != 0:
            raise TransportUnavailable(f"Mooncake initialize({mc_host}, P2PHANDSHAKE, {protocol}) = {rc}")
        self.session_id = f"{mc_host}:{self._engine.get_rpc_port()}"
        self._staging: dict[str, np.ndarray] = {}
        self._staging_lock = threading.Lock()
        self._landings = Landings(self._register_buffer, quarantine_s=timeout_s)
        super().__init__(host=host, port=port, advertise_host=advertise_host,
                         auth_token=auth_token, timeout_s=timeout_s, limits=limits,
                         on_frame=self._serve_frame, frame_limits=wire.LANDING_LIMITS,
                         on_close=self._landings.give_back)

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
            buffers, self._staging = [*self._staging.values(), *self._landings.buffers], {}
        for buffer in buffers:
            self._engine.unregister_memory(buffer.ctypes.data)

    def _welcome(self) -> dict:
        return {**super()._welcome(), "session": self.session_id}

    def _move(self, link: PeerLink, sock: socket.socket, handle: BatchHandle, batch: Batch) -> None:
        """Submit the batch as single-segment Mooncake batches and wait for them in turn
        (see the module docstring); many small pieces move chunk by chunk through our
        staging buffer, the peer's landing buffer, or both (``chunk_plan``)."""
        submit = (self._engine.batch_transfer_async_write if batch.is_write
                  else self._engine.batch_transfer_async_read)
        segments_ = _Segments(self._engine, handle, submit, link.info["session"])
        plan = chunk_plan(batch)
        if plan is None:
            rows = zip(batch.local.tolist(), batch.remote.tolist(), batch.lengths.tolist(), strict=True)
            if segments_.submit(rows, 0) and segments_.wait_until(0):
                handle.finish()
            return
        landing = self._landing(link, sock, handle) if plan.land else None
        if not handle.status().is_pending:
            return
        if plan.land and landing is None:
            plan = plan.without_landing()
        if self._run_chunks(link, sock, handle, plan, segments_, landing):
            handle.finish()

    def _run_chunks(self, link: PeerLink, sock: socket.socket, handle: BatchHandle,
                    plan: ChunkPlan, segments_: _Segments, landing: int | None) -> bool:
        """Move ``plan`` chunk by chunk, each in one of ``NUM_SLOTS`` slots of our staging
        buffer and of the peer's landing buffer: a chunk is packed (a write's gathered,
        a read's gathered by the peer) while the one before it moves. False once
        ``handle`` failed."""
        staging = self._staging_for(link.peer).ctypes.data if plan.stage else None
        regions, is_write = self._regions.as_list(), plan.batch.is_write
        moving: collections.deque[tuple[int, Chunk]] = collections.deque()  # submitted
        scattering: collections.deque[tuple[int, _Asked]] = collections.deque()  # peer copies

        def settle_oldest() -> bool:
            """The oldest moving chunk's segments landed: finish its copy out."""
            i, chunk = moving.popleft()
            if not segments_.wait_until(i):
                return False
            slot = (i % NUM_SLOTS) * SLOT_BYTES
            if landing is not None and is_write:
                asked = self._ask(link, sock, handle, wire.OP_SCATTER, _landing_body(slot, chunk))
                scattering.append((i, asked))
            if staging is not None and not is_write:
                copy_packed(staging + slot, chunk.local, chunk.lengths, regions, into_pieces=True)
            return True

        for i, chunk in enumerate(plan.chunks()):
            slot = (i % NUM_SLOTS) * SLOT_BYTES
            if len(moving) == NUM_SLOTS and not settle_oldest():  # the slot's last chunk
                return False
            while scattering and scattering[0][0] <= i - NUM_SLOTS:
                if not self._settled(handle, scattering.popleft()[1]):
                    return False
            if staging is not None and is_write:
                copy_packed(staging + slot, chunk.local, chunk.lengths, regions, into_pieces=False)
            if landing is not None and not is_write:
                asked = self._ask(link, sock, handle, wire.OP_GATHER, _landing_body(slot, chunk))
                if not self._settled(handle, asked):
                    return False
            here = chunk.local if staging is None else staging + slot + chunk.offsets
            there = chunk.remote if landing is None else landing + slot + chunk.offsets
            if not segments_.submit(segments(here, there, chunk.lengths), i):
                return False
            moving.append((i, chunk))
        while moving:
            if not settle_oldest():
                return False
        return all(self._settled(handle, asked) for _, asked in scattering)

    def _landing(self, link: PeerLink, sock: socket.socket, handle: BatchHandle) -> int | None:
        """The address of the landing buffer the peer lends this connection (asked once
        per connection); None where it has none free (or ``handle`` failed meanwhile)."""
        if "landing" not in link.info:
            asked = self._ask(link, sock, handle, wire.OP_LAND, b"")
            status = asked.wait()
            if asked.refused:
                return None
            if not status.is_done:
                handle.fail(status.message)
                return None
            info = json.loads(asked.reply)
            if info.get("slot_bytes") != SLOT_BYTES or info.get("num_slots") != NUM_SLOTS:
                raise ValueError(f"peer {link.peer} lends landing slots we cannot use: {info}")
            link.info["landing"] = int(info["addr"])
        return link.info["landing"]

    def _ask(self, link: PeerLink, sock: socket.socket, handle: BatchHandle, op: int,
             body: bytes) -> _Asked:
        """Send ``op`` to the peer's channel; the returned handle ends with its answer
        (ACK, or LANDING whose body it keeps; NACK fails it with the reason), by
        ``handle``'s deadline at the latest."""
        asked = _Asked(link.peer, 0, max(0.0, handle.deadline - time.monotonic()))

        def on_reply(_sock, reply_op: int, reply: bytes) -> None:
            if reply_op == wire.OP_NACK:
                asked.refused = True
                asked.fail(f"peer refused {wire.OP_NAMES[op]}: {reply.decode(errors='replace')}")
            elif reply_op in (wire.OP_ACK, wire.OP_LANDING):
                asked.reply = reply
                asked.finish()
            else:
                raise ValueError(f"unexpected reply op {reply_op} to {wire.OP_NAMES[op]}")

        link.expect(asked, on_reply)
        wire.send_frame(sock, op, asked.batch_id, body)
        return asked

    @staticmethod
    def _settled(handle: BatchHandle, asked: BatchHandle) -> bool:
        """Wait for the peer's answer to ``asked``; False (``handle`` failed) unless ACKed."""
        status = asked.wait()
        if status.is_done:
            return True
        handle.fail(status.message)
        return False

    def _staging_for(self, peer: str) -> np.ndarray:
        """This peer's staging buffer (its sender thread is the only user), registered
        with Mooncake on first use and released at close."""
        with self._staging_lock:
            buffer = self._staging.get(peer)
            if buffer is None:
                buffer = np.empty(NUM_SLOTS * SLOT_BYTES, dtype=np.uint8)
                self._register_buffer(buffer)
                self._staging[peer] = buffer
            return buffer

    def _register_buffer(self, buffer: np.ndarray) -> None:
        rc = self._engine.register_memory(buffer.ctypes.data, buffer.nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory(staging, {buffer.nbytes}) = {rc}")

    # -- server side (the connection's thread): the landing buffer this peer may use -----

    def _serve_frame(self, sock: socket.socket, op: int, batch_id: int, body: bytes,
                     peer: str) -> None:
        if op == wire.OP_LAND:
            try:
                buffer = self._landings.lend(sock)
            except RuntimeError as exc:
                buffer, reason = None, str(exc)
            else:
                reason = f"every landing buffer is lent ({self._landings.max_count})"
            if buffer is None:
                wire.send_frame(sock, wire.OP_NACK, batch_id, reason.encode())
                return
            info = {"addr": buffer.ctypes.data, "slot_bytes": SLOT_BYTES, "num_slots": NUM_SLOTS}
            wire.send_frame(sock, wire.OP_LANDING, batch_id, json.dumps(info).encode())
            return
        if len(body) < 8:
            raise wire.FrameError("malformed landing table", f"{len(body)} bytes")
        offset = int.from_bytes(body[:8], "little")
        addrs, lengths = wire.decode_table(body[8:])
        buffer = self._landings.of(sock)
        problem = self._regions.check(addrs, lengths, side="remote")
        if buffer is None:
            problem = "no landing buffer is lent to this connection"
        elif problem is None and offset + int(lengths.sum()) > buffer.nbytes:
            problem = f"{int(lengths.sum())} bytes at {offset} overflow the landing buffer"
        if problem is not None:
            wire.send_frame(sock, wire.OP_NACK, batch_id, f"refused: {problem}".encode())
            return
        copy_packed(buffer.ctypes.data + offset, addrs, lengths, self._regions.as_list(),
                    into_pieces=op == wire.OP_SCATTER)
        wire.send_frame(sock, wire.OP_ACK, batch_id)


class _Segments:
    """A batch's Mooncake segments in flight, each its own one-segment batch, at most
    ``MAX_IN_FLIGHT`` at once, awaited in submission order; each carries the tag of
    the chunk it belongs to. Every method returns False once the handle failed (a
    segment failed, Mooncake refused one, or the deadline passed)."""

    def __init__(self, engine, handle: BatchHandle, submit, session: str) -> None:
        self._engine, self._handle, self._submit, self._session = engine, handle, submit, session
        self._in_flight: collections.deque[tuple[int, int]] = collections.deque()  # id, tag

    def submit(self, rows, tag: int) -> bool:
        """Submit every (local, remote, length) row, waiting for the oldest when full."""
        for local, remote, length in rows:
            if len(self._in_flight) >= MAX_IN_FLIGHT and not self._wait_oldest():
                return False
            batch_id = self._submit(self._session, [local], [remote], [length])
            if batch_id <= 0:
                self._handle.fail(f"Mooncake refused to submit the batch ({batch_id})")
                return False
            self._in_flight.append((batch_id, tag))
        return True

    def wait_until(self, tag: int) -> bool:
        """Wait for every segment tagged ``tag`` or earlier."""
        while self._in_flight and self._in_flight[0][1] <= tag:
            if not self._wait_oldest():
                return False
        return True

    def _wait_oldest(self) -> bool:
        batch_id, status = self._in_flight.popleft()[0], 0

        def is_pending() -> bool:
            nonlocal status
            status = self._engine.transfer_check_status(batch_id)  # 0 pending, 1 done, <0 failed
            return status == 0

        poll_while(is_pending, self._handle)
        if status < 0:
            self._handle.fail(f"Mooncake batch to {self._session} failed (status {status})")
            return False
        return status != 0  # still 0: the deadline passed, and the handle says so


class _Asked(BatchHandle):
    """A question to the peer's channel (OP_LAND, OP_SCATTER, OP_GATHER) and its answer."""

    reply: bytes = b""
    refused: bool = False  # NACKed: the peer answered no, the link is fine


def _landing_body(slot: int, chunk: Chunk) -> bytes:
    """A SCATTER or GATHER body: the chunk's place in the landing buffer, then its pieces."""
    return slot.to_bytes(8, "little") + wire.encode_table(chunk.remote, chunk.lengths)


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
