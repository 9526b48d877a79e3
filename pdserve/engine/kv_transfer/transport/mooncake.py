"""Mooncake Transfer Engine transport (RDMA in production, its TCP protocol elsewhere).

Wraps ``mooncake.engine.TransferEngine`` in P2PHANDSHAKE mode (no metadata server):
each side's Mooncake session is "host:rpc_port". Our endpoint is the channel's
address; the peer's Mooncake session id and registered regions come from its
WELCOME reply, which also authenticates us. Notifications travel on the channel,
since Mooncake's own notify needs its metadata service.

Why batches complete on the per-peer sender thread: ``get_batch_transfer_status``
busy-spins a core until the whole batch ends (``transfer_check_status`` only looks
at the first task), so it must never run on the engine's compute thread. The call
releases the GIL. Mooncake's own deadline (MC_TRANSFER_TIMEOUT, at least 5 s) can
outlast ours: ``poll`` FAILs the batch at our deadline and the late result is ignored.

Invariants: remote ranges are checked against the peer's advertised regions before
submission (Mooncake also refuses them server-side); the process environment gets
MC_FORCE_TCP=1 for protocol "tcp" and MC_TRANSFER_TIMEOUT unless already set.
"""

from __future__ import annotations

import math
import os
import socket

from pdserve.engine.kv_transfer.transport.base import BatchHandle, Regions
from pdserve.engine.kv_transfer.transport.channel_transport import Batch, ChannelTransport
from pdserve.engine.kv_transfer.transport.limits import ChannelLimits
from pdserve.engine.kv_transfer.transport.link import PeerLink

_MIN_MOONCAKE_TIMEOUT_S = 5


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
        device_name: str = "",
        auth_token: str | None = None,
        timeout_s: float = 10.0,
        limits: ChannelLimits | None = None,
    ) -> None:
        if protocol == "tcp":
            os.environ.setdefault("MC_FORCE_TCP", "1")
        os.environ.setdefault(
            "MC_TRANSFER_TIMEOUT", str(max(_MIN_MOONCAKE_TIMEOUT_S, math.ceil(timeout_s)))
        )
        from mooncake.engine import TransferEngine  # imported late: env must be set first

        self._engine = TransferEngine()
        mc_host = advertise_host or host
        rc = self._engine.initialize(mc_host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise RuntimeError(f"Mooncake initialize({mc_host}, P2PHANDSHAKE, {protocol}) = {rc}")
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
        """Submit to Mooncake and wait here for the whole batch (see the module docstring)."""
        engine, session = self._engine, link.info["session"]
        submit = (engine.batch_transfer_async_write if batch.is_write
                  else engine.batch_transfer_async_read)
        local, remote, lengths = batch.local.tolist(), batch.remote.tolist(), batch.lengths.tolist()
        batch_id = submit(session, local, remote, lengths)
        if batch_id <= 0:
            handle.fail(f"Mooncake refused to submit the batch ({batch_id})")
            return
        rc = engine.get_batch_transfer_status([batch_id])  # spins; GIL released
        if rc == 0:
            handle.finish()
        else:
            handle.fail(f"Mooncake batch to {session} failed (rc={rc})")
