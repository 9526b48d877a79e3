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

Invariants: remote ranges are checked against the peer's advertised regions before
submission (Mooncake also refuses them server-side); the process environment gets
MC_FORCE_TCP=1 for protocol "tcp" and MC_TRANSFER_TIMEOUT unless already set.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
import socket

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

    def _welcome(self) -> dict:
        return {**super()._welcome(), "session": self.session_id}

    def _move(self, link: PeerLink, sock: socket.socket, handle: BatchHandle, batch: Batch) -> None:
        """Submit one single-segment Mooncake batch per item, at most ``MAX_IN_FLIGHT`` at
        a time, and wait for each in turn (see the module docstring)."""
        engine, session = self._engine, link.info["session"]
        submit = (engine.batch_transfer_async_write if batch.is_write
                  else engine.batch_transfer_async_read)
        items = zip(batch.local.tolist(), batch.remote.tolist(), batch.lengths.tolist(), strict=True)
        in_flight: collections.deque[int] = collections.deque()
        while True:
            for local, remote, length in itertools.islice(items, MAX_IN_FLIGHT - len(in_flight)):
                batch_id = submit(session, [local], [remote], [length])
                if batch_id <= 0:
                    handle.fail(f"Mooncake refused to submit the batch ({batch_id})")
                    return
                in_flight.append(batch_id)
            if not in_flight:
                break
            batch_id, status = in_flight.popleft(), 0

            def is_pending(batch_id=batch_id) -> bool:
                nonlocal status
                status = engine.transfer_check_status(batch_id)  # 0 pending, 1 done, <0 failed
                return status == 0

            poll_while(is_pending, handle)
            if status < 0:
                handle.fail(f"Mooncake batch to {session} failed (status {status})")
                return
            if status == 0:
                return  # the deadline passed: the handle says so
        handle.finish()


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
