"""Worker half of the KV connector: memory registration, handshakes, moving bytes.

Called by the prefill and decode sides (``prefill.py``, ``decode.py``) on the engine
thread, except the layer-wise sender thread, which turns "layer i is computed" into
write batches off the compute thread. The worker knows byte ranges and peers; it
never decides when a request's blocks may be freed, and only the connector reaches
it (the engine and the server go through ``base.KVConnector``).

A probe (probe.py) uses two more things here: PROBE messages are answered in
``receive`` like HELLO (a fresh layout check that leaves the handshake cache alone),
and ``read_probe`` reads one block run of a peer's KV region into ``scratch``, a
small buffer registered with the transport at start-up that no request ever uses.

Invariant: a write job counts in ``PrefillTransfer.num_jobs_queued`` from the moment
it is queued until its batch has been submitted, so the prefill side can tell "every
write issued and settled" from "some still to come".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pdserve.engine.kv_transfer import messages
from pdserve.engine.kv_transfer.layout import KVLayout, token_range_items
from pdserve.engine.kv_transfer.transport.base import BatchHandle, TransferItem, Transport

log = logging.getLogger(__name__)


@dataclass
class Scratch:
    """The probes' buffer: ``num_bytes`` at ``addr``, kept alive by ``owner``; ``release``
    (called once by ``close``, after the transport stopped) frees what must be freed."""

    addr: int
    num_bytes: int
    owner: object = None
    release: Callable[[], None] = lambda: None


class ConnectorWorker:
    def __init__(self, transport: Transport, layout: KVLayout, fault_send_delay_s: float = 0.0,
                 scratch: Scratch | None = None) -> None:
        """``scratch``: the probes' private buffer (None: probes do no test transfer)."""
        self.transport = transport
        self._fault_send_delay_s = fault_send_delay_s
        self.layout = layout
        transport.register_memory(layout.base_addr, layout.region_bytes)
        self.scratch = scratch
        if scratch is not None:
            transport.register_memory(scratch.addr, scratch.num_bytes)
        self.peers: dict[str, KVLayout] = {}  # handshake cache
        self.rejected: dict[str, str] = {}  # peer -> why it is incompatible
        self._hello_sent: set[str] = set()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="kv-sender", daemon=True)
        self._sender.start()

    @property
    def endpoint(self) -> str:
        return self.transport.endpoint

    def close(self) -> None:
        self._jobs.put(None)
        self._sender.join(5.0)
        self.transport.close()
        if self.scratch is not None:
            self.scratch.release()

    # -- control messages ------------------------------------------------------

    def send(self, peer: str, kind: str, **fields) -> None:
        try:
            self.transport.notify(peer, messages.encode(kind, self.endpoint, **fields))
        except Exception as exc:  # noqa: BLE001 - an unreachable peer shows up as a deadline
            log.warning("cannot send %s to %s: %s", kind, peer, exc)

    def handshake(self, peer: str) -> str | None:
        """'ready', None while pending, or the rejection reason. Sends HELLO once."""
        if peer in self.rejected:
            return self.rejected[peer]
        if peer in self.peers:
            return "ready"
        if peer not in self._hello_sent:
            self._hello_sent.add(peer)
            self.send(peer, "HELLO", layout=self.layout.to_dict())
        return None

    def forget_peer(self, peer: str) -> None:
        self.peers.pop(peer, None)
        self.rejected.pop(peer, None)
        self._hello_sent.discard(peer)

    def receive(self) -> list[dict]:
        """Drain incoming messages; handshakes are answered here, the rest returned, each
        with ``rx_s``: when it came off the wire (monotonic)."""
        out = []
        for _, raw, received_s in self.transport.recv_notifications():
            try:
                msg = messages.decode(raw)
            except messages.MessageError as exc:
                log.warning("dropping malformed KV control message: %s", exc)
                continue
            msg["rx_s"] = received_s
            kind, peer = msg["t"], msg["from"]
            if kind in ("HELLO", "HELLO_ACK"):
                self._on_hello(peer, msg, reply=kind == "HELLO")
            elif kind == "HELLO_REJECT":
                self.rejected[peer] = str(msg.get("reason", "rejected by peer"))
            elif kind == "PROBE":
                self._on_probe(peer, msg)
            else:
                out.append(msg)
        return out

    def _on_hello(self, peer: str, msg: dict, reply: bool) -> None:
        try:
            theirs = KVLayout.from_dict(msg["layout"])
        except (KeyError, TypeError, ValueError) as exc:
            self.rejected[peer] = f"malformed handshake: {exc}"
            return
        reason = self.layout.mismatch(theirs)
        if reason is None and msg["layout"].get("compat_hash") != theirs.compat_hash:
            reason = "compatibility hash does not match the layout it was sent with"
        if reason is not None:
            reason = f"incompatible KV layout with {peer}: {reason}"
            log.warning("%s", reason)
            self.rejected[peer] = reason
            if reply:
                self.send(peer, "HELLO_REJECT", reason=reason)
            return
        if peer not in self.peers and theirs.local_kv_heads != self.layout.local_kv_heads:
            log.info("KV for %s is re-laid out in transit (%d KV heads per rank here, %d "
                     "there): one item per token and run of heads", peer,
                     self.layout.local_kv_heads, theirs.local_kv_heads)
        self.peers[peer] = theirs
        self.rejected.pop(peer, None)
        if reply:
            self.send(peer, "HELLO_ACK", layout=self.layout.to_dict())

    def _on_probe(self, peer: str, msg: dict) -> None:
        """Answer a peer's probe with our layout, or with why the layouts differ."""
        try:
            reason = self.layout.mismatch(KVLayout.from_dict(msg["layout"]))
        except (KeyError, TypeError, ValueError) as exc:
            reason = f"malformed probe: {exc}"
        if reason is None:
            self.send(peer, "PROBE_ACK", x=msg["x"], layout=self.layout.to_dict())
        else:
            self.send(peer, "PROBE_REJECT", x=msg["x"],
                      reason=f"incompatible KV layout with {self.endpoint}: {reason}")

    def read_probe(self, peer: str, remote: KVLayout) -> BatchHandle:
        """A probe's test transfer: read the first run of the peer's KV region (its
        block 0, layer 0, K; at most the scratch size) into ``scratch``. Reading moves
        real bytes over the transport and changes nothing on either side; the bytes
        are discarded. Requires ``scratch``."""
        assert self.scratch is not None
        num_bytes = min(self.scratch.num_bytes, remote.block_bytes)
        item = TransferItem(self.scratch.addr, remote.block_addr(0, 0, 0), num_bytes)
        return self.transport.read_batch(peer, [item])

    def reach(self, peer: str) -> BatchHandle:
        """An empty read: it connects (channel handshake and token check) without moving
        bytes, so a dead or refusing endpoint fails it with the connection's error."""
        return self.transport.read_batch(peer, [])

    # -- write grants (D) --------------------------------------------------------------

    def grant_blocks(self, xfer) -> None:
        """D: let the peer write exactly into this transfer's reserved blocks (not the
        leading ones shared from D's prefix cache, which other requests read)."""
        lay = self.layout
        blocks = np.asarray(xfer.request.block_table[xfer.skip_blocks:], dtype=np.int64)
        starts = np.concatenate([
            lay.block_addr(layer, kv, blocks, rank)
            for rank in range(lay.tp_size) for layer in range(lay.num_layers) for kv in (0, 1)
        ])
        ranges = np.stack([starts, np.full_like(starts, lay.block_bytes)], axis=1)
        self.transport.grant(xfer.peer, xfer.transfer_id, ranges)

    def revoke(self, xfer) -> bool:
        """D: end the transfer's grant; True once no write of it can land any more."""
        try:
            return self.transport.revoke(xfer.transfer_id)
        except Exception as exc:  # noqa: BLE001 - treated as "cannot promise"
            log.warning("revoking transfer %s failed: %s", xfer.transfer_id, exc)
            return False

    # -- bytes -------------------------------------------------------------------

    def queue_write(self, xfer, layers: range, start: int, end: int) -> None:
        """Queue writes of tokens [start, end) in ``layers`` to the transfer's peer."""
        if end <= start:
            return
        with xfer.lock:
            xfer.num_jobs_queued += 1
        self._jobs.put((xfer, layers, start, end))

    def read(self, xfer, start: int, end: int) -> BatchHandle:
        """Pull mode (D): read tokens [start, end) of all layers from the peer's blocks."""
        remote = self.peers[xfer.peer]
        items = token_range_items(self.layout, remote, xfer.request.block_table,
                                  xfer.remote_blocks, range(self.layout.num_layers), start, end,
                                  local_is_source=False)
        return self.transport.read_batch(xfer.peer, items)

    def layer_hook(self, plan: list[tuple[object, int, int]]):
        """A callback for the model: after layer i, queue that layer's writes in ``plan``."""
        if not plan:
            return None

        def on_layer(i: int) -> None:
            for xfer, start, end in plan:
                self.queue_write(xfer, range(i, i + 1), start, end)

        return on_layer

    def _send_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            xfer, layers, start, end = job
            try:
                if self._fault_send_delay_s:
                    time.sleep(self._fault_send_delay_s)
                if not xfer.cancelled:
                    remote = self.peers[xfer.peer]
                    items = token_range_items(self.layout, remote, xfer.request.block_table,
                                              xfer.remote_blocks, layers, start, end)
                    handle = self.transport.write_batch(xfer.peer, items)
                    with xfer.lock:
                        xfer.handles.append(handle)
            except Exception as exc:  # noqa: BLE001 - recorded on the transfer, never fatal
                log.warning("transfer %s: write failed to start: %s", xfer.transfer_id, exc)
                with xfer.lock:
                    xfer.error = xfer.error or f"write failed to start: {exc}"
            finally:
                with xfer.lock:
                    xfer.num_jobs_queued -= 1
