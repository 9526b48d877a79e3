"""Our own TCP transport: KV bytes over the channel's sockets, for nodes without Mooncake.

Owns the WRITE/READ ops of the channel. A batch is one frame: a table of
(remote_addr, length) pairs, then every item's bytes back to back, gathered by
``sendmsg`` from our registered memory and scattered by ``recvmsg`` straight into
the peer's registered memory (wire.py: iovec arrays, no Python object per piece).

Invariants:
- Local items are checked against our registered regions before anything is sent;
  remote items are checked by us against the regions the peer advertised and again
  by the peer, which refuses (NACK) a batch that leaves its registered memory and
  drains its payload without writing a byte of it.
- One sender thread per peer, so batches and notifies to a peer stay in order.
"""

from __future__ import annotations

import socket

import numpy as np

from pdserve.engine.kv_transfer.transport import wire
from pdserve.engine.kv_transfer.transport.base import BatchHandle
from pdserve.engine.kv_transfer.transport.channel_transport import Batch, ChannelTransport
from pdserve.engine.kv_transfer.transport.grants import WriteGrants
from pdserve.engine.kv_transfer.transport.limits import ChannelLimits
from pdserve.engine.kv_transfer.transport.link import PeerLink


class TcpTransport(ChannelTransport):
    name = "tcp"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        auth_token: str | None = None,
        timeout_s: float = 10.0,
        require_grants: bool = False,
        limits: ChannelLimits | None = None,
    ) -> None:
        """``require_grants``: accept writes only inside ranges granted to the writer
        (engines turn this on; see grants.py), which makes ``revoke`` a real fence."""
        self.require_grants = require_grants
        self._grants = WriteGrants()
        super().__init__(host=host, port=port, advertise_host=advertise_host,
                         auth_token=auth_token, timeout_s=timeout_s, on_frame=self._serve_frame,
                         limits=limits)

    def grant(self, peer: str, tag: str, ranges: np.ndarray) -> None:
        self._grants.grant(peer, tag, ranges)

    def revoke(self, tag: str) -> bool:
        # A write landing in revoked memory is cut off: its recvmsg fails at once.
        return self._grants.revoke(tag, cut=wire.shutdown, timeout_s=self.timeout_s)

    # -- client side (runs on the peer's sender thread) --------------------------------

    def _move(self, link: PeerLink, sock: socket.socket, handle: BatchHandle, batch: Batch) -> None:
        """One WRITE (table + payload) or READ frame; the reply finishes the batch."""
        op = wire.OP_WRITE if batch.is_write else wire.OP_READ
        iov = np.stack([batch.local, batch.lengths], axis=1)
        link.expect(handle, lambda s, rop, body: _on_reply(handle, s, rop, body, iov))
        payload = iov if op == wire.OP_WRITE else None
        table = wire.encode_table(batch.remote, batch.lengths)
        wire.send_frame(sock, op, handle.batch_id, table, payload)

    # -- server side (runs on the connection's thread) ---------------------------------

    def _serve_frame(
        self, sock: socket.socket, op: int, batch_id: int, body: bytes, peer: str
    ) -> None:
        addrs, lengths = wire.decode_table(body)
        problem = self._regions.check(addrs, lengths, side="remote")
        token = None
        if problem is None and op == wire.OP_WRITE and self.require_grants:
            token = self._grants.begin_write(peer, addrs, lengths, sock)
            if isinstance(token, str):
                problem, token = token, None
        if problem is not None:
            if op == wire.OP_WRITE:
                wire.drain(sock, int(lengths.sum()))
            wire.send_frame(sock, wire.OP_NACK, batch_id, f"refused: {problem}".encode())
        elif op == wire.OP_WRITE:
            try:
                wire.recv_payload(sock, np.stack([addrs, lengths], axis=1))
            finally:
                if token is not None:
                    self._grants.end_write(token)
            wire.send_frame(sock, wire.OP_ACK, batch_id)
        elif op == wire.OP_READ:
            wire.send_frame(sock, wire.OP_DATA, batch_id, b"", np.stack([addrs, lengths], axis=1))
        else:
            raise ValueError(f"unexpected op {op}")


def _on_reply(
    handle: BatchHandle, sock: socket.socket, op: int, body: bytes, local_iov: np.ndarray
) -> None:
    """Reader thread: finish a batch from its ACK/NACK, or land a READ's DATA payload."""
    if op == wire.OP_ACK:
        handle.finish()
    elif op == wire.OP_DATA:
        wire.recv_payload(sock, local_iov)
        handle.finish()
    elif op == wire.OP_NACK:
        handle.fail(body.decode(errors="replace"))
    else:
        raise ValueError(f"unexpected reply op {op}")

