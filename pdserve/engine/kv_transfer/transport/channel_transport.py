"""The part of a transport that tcp, shm, mooncake and nixl share: regions, channel, one submit path.

``ChannelTransport`` is a ``Transport`` built on a ``Channel``: it owns the registered
regions, a channel whose WELCOME advertises them, notify, and ``write_batch`` /
``read_batch`` as one template. A transport subclass states only what differs: its
constructor options, what else its WELCOME carries, and how a checked batch moves.

A batch, from the caller's thread to the peer's sender thread::

    items --coalesce--> Batch, BatchHandle (PENDING)
      local range outside our regions      -> FAILED   (no peer contacted)
      empty and finishes_empty_batches     -> DONE     (no peer contacted)
      otherwise queued on the peer's link; on its sender thread:
        connect (HELLO/WELCOME, auth), _check_peer
        remote range outside the peer's advertised regions -> FAILED
        _move: the transport's own part; it finishes the handle or registers the
               reply that will

Invariants: ``write_batch``/``read_batch`` only check and queue, never block on the
network; no byte moves before both range checks passed; a check that fails names the
first range outside, in ``Regions.check``'s words.
"""

from __future__ import annotations

import abc
import socket
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from pdserve.engine.kv_transfer.transport import wire
from pdserve.engine.kv_transfer.transport.base import (
    BatchHandle,
    Items,
    Regions,
    Transport,
    coalesce,
)
from pdserve.engine.kv_transfer.transport.channel import Channel, FrameHandler
from pdserve.engine.kv_transfer.transport.limits import ChannelLimits
from pdserve.engine.kv_transfer.transport.link import PeerLink


class Batch(NamedTuple):
    """One coalesced batch as columns (views of one int64 array), and its direction."""

    local: np.ndarray
    remote: np.ndarray
    lengths: np.ndarray
    is_write: bool


class ChannelTransport(Transport):
    """Subclasses set their own attributes, then call ``__init__`` last (it starts the
    listener, whose WELCOME may read them), and implement ``_move``."""

    # True: a batch with nothing to move is DONE at once, without reaching the peer.
    # False: it travels like any other (and so still fails on a dead or refusing peer).
    finishes_empty_batches: bool = False

    def __init__(
        self, *, host: str, port: int, auth_token: str | None, timeout_s: float,
        advertise_host: str | None = None, on_frame: FrameHandler | None = None,
        limits: ChannelLimits | None = None, frame_limits: Mapping[int, int] | None = None,
        on_close: Callable[[socket.socket], None] | None = None,
    ) -> None:
        """``on_frame`` serves the ops the channel itself does not (tcp's WRITE/READ,
        or those ``frame_limits`` names); ``on_close`` hears of each served connection's
        end; ``limits`` caps what peers may cost the port (None: ``ChannelLimits()``)."""
        self.timeout_s = timeout_s
        self._regions = Regions()
        self._channel = Channel(
            info=self._welcome, on_frame=on_frame, host=host, port=port,
            advertise_host=advertise_host, auth_token=auth_token, timeout_s=timeout_s,
            limits=limits, frame_limits=frame_limits, on_close=on_close,
        )

    @property
    def endpoint(self) -> str:
        return self._channel.endpoint

    def register_memory(self, ptr: int, length: int) -> None:
        self._regions.add(ptr, length)

    def write_batch(self, peer: str, items: Items) -> BatchHandle:
        return self._submit(peer, items, is_write=True)

    def read_batch(self, peer: str, items: Items) -> BatchHandle:
        return self._submit(peer, items, is_write=False)

    def notify(self, peer: str, message: bytes) -> None:
        self._channel.link(peer).submit(
            None, lambda link: wire.send_frame(link.connect(), wire.OP_NOTIFY, body=message)
        )

    def recv_notifications(self) -> list[tuple[str, bytes, float]]:
        return self._channel.notifications()

    def set_notify_hook(self, hook) -> None:
        self._channel.on_notify = hook

    def close(self) -> None:
        self._channel.close()

    def _welcome(self) -> dict:
        """What the WELCOME reply tells a peer that connects (its connection's thread).
        Subclasses add to it; ``regions`` is what the peer checks remote ranges against."""
        return {"regions": self._regions.as_list()}

    def _submit(self, peer: str, items: Items, *, is_write: bool) -> BatchHandle:
        arr = coalesce(items)
        batch = Batch(arr[:, 0], arr[:, 1], arr[:, 2], is_write)
        handle = BatchHandle(peer, int(batch.lengths.sum()), self.timeout_s)
        problem = self._regions.check(batch.local, batch.lengths)
        if problem is not None:
            handle.fail(problem)
        elif not len(arr) and self.finishes_empty_batches:
            handle.finish()
        else:
            self._channel.link(peer).submit(handle, lambda link: self._run(link, handle, batch))
        return handle

    def _run(self, link: PeerLink, handle: BatchHandle, batch: Batch) -> None:
        """The peer's sender thread: connect, check the peer and its ranges, then move."""
        sock = link.connect()
        self._check_peer(link)
        problem = self._regions.check(
            batch.remote, batch.lengths, side="remote", ranges=link.info["regions"]
        )
        if problem is not None:
            handle.fail(problem)
            return
        self._move(link, sock, handle, batch)

    def _check_peer(self, link: PeerLink) -> None:
        """Sender thread, just after connect: raise if this transport cannot serve the
        peer at all (the batch FAILs with the reason and the link resets)."""

    def _fence(self, link: PeerLink, sock: socket.socket, handle: BatchHandle) -> None:
        """Sender thread, once the bytes moved without the peer's help (shm, nixl): FENCE
        on the channel; the peer's ACK finishes ``handle``, so a dead or stopped peer
        still FAILs it, and a later notify arrives after the bytes."""
        link.expect(handle, lambda s, op, body: _on_fence(handle, op))
        wire.send_frame(sock, wire.OP_FENCE, handle.batch_id)

    @abc.abstractmethod
    def _move(self, link: PeerLink, sock: socket.socket, handle: BatchHandle, batch: Batch) -> None:
        """Sender thread, both range checks passed: move ``batch`` and finish ``handle``,
        or send the request and ``link.expect`` the reply that finishes it. An OSError,
        ValueError or RuntimeError raised here FAILs the batch and resets the link."""


def _on_fence(handle: BatchHandle, op: int) -> None:
    if op == wire.OP_ACK:
        handle.finish()
    else:
        handle.fail(f"unexpected reply op {op} to fence")
