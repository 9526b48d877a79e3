"""The connector an engine holds: one prefill side, one decode side, one worker.

Implements ``base.KVConnector``. Probes of peers (probe.py) live beside the sides and
are driven in the same ``collect_events``. A hybrid engine may take either leg, so both sides
always exist; each admitted request goes to the side its ``KVTransferParams.role``
names, each control message to the side whose transfer it names. A message for a
transfer not admitted yet is kept (``done_s`` at most) and replayed on admission:
D's RESERVE may overtake the Coordinator's request to P. Engine thread only, except
the pairing properties.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_transfer.base import ConnectorEvents, KVConnector, LayerHook
from pdserve.engine.kv_transfer.common import ConnectorTimeouts, Side, Transfer
from pdserve.engine.kv_transfer.decode import DecodeSide
from pdserve.engine.kv_transfer.layout import KVLayout
from pdserve.engine.kv_transfer.messages import PROBE_REPLIES
from pdserve.engine.kv_transfer.params import KVTransferParams
from pdserve.engine.kv_transfer.prefill import PrefillSide
from pdserve.engine.kv_transfer.probe import PeerProbes, ProbeDone
from pdserve.engine.kv_transfer.worker import ConnectorWorker
from pdserve.engine.request import Request


@dataclass
class TransferStats:
    """Running totals of finished KV transfers (``stats()`` reports them). A transfer
    refused for want of D's blocks counts in ``num_refused``, one whose request was
    aborted in ``num_cancelled``; neither as failed."""

    num_ok: int = 0
    num_failed: int = 0
    num_refused: int = 0
    num_cancelled: int = 0
    num_bytes: int = 0
    exposed_s_total: float = 0.0  # P: time from prefill end to every write settled
    duration_s_total: float = 0.0

    def record(self, xfer, ok: bool) -> None:
        now = time.monotonic()
        if not ok:
            if xfer.is_full:
                self.num_refused += 1
            elif xfer.is_cancelled:
                self.num_cancelled += 1
            else:
                self.num_failed += 1
            return
        self.num_ok += 1
        self.num_bytes += sum(h.num_bytes for h in xfer.handles)
        self.duration_s_total += now - xfer.started_s
        if xfer.params.role == "prefill" and xfer.prefill_done_s is not None:
            self.exposed_s_total += now - xfer.prefill_done_s


class DispatchConnector(KVConnector):
    def __init__(self, worker: ConnectorWorker, block_manager: BlockManager,
                 timeouts: ConnectorTimeouts | None = None,
                 decode_allocation: str = "dispatch", partial: bool = True) -> None:
        self._worker = worker
        self.timeouts = timeouts or ConnectorTimeouts()
        self.transfer_stats = TransferStats()
        self._observers = [self.transfer_stats.record]
        self._events = ConnectorEvents()  # raised by both sides, drained by collect_events
        shared = (worker, block_manager, self.timeouts, decode_allocation, self._events,
                  self._observers)
        self.prefill = PrefillSide(*shared)
        self.decode = DecodeSide(*shared)
        self.decode.partial = partial
        self._sides: dict[str, Side] = {"prefill": self.prefill, "decode": self.decode}
        self._early: dict[str, list[tuple[float, dict]]] = {}  # messages before admission
        self.probes = PeerProbes(worker)

    # -- pairing -----------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return self._worker.endpoint

    @property
    def transport_name(self) -> str:
        return self._worker.transport.name

    @property
    def layout(self) -> KVLayout:
        return self._worker.layout

    # -- probes and wake-ups ---------------------------------------------------------------

    def probe(self, peer: str, test_transfer: bool, timeout_s: float, done: ProbeDone) -> None:
        self.probes.start(peer, test_transfer, timeout_s, done)

    def set_wakeup(self, wake) -> None:
        self._worker.transport.set_notify_hook(wake)

    # -- admission -----------------------------------------------------------------------

    def has_transfer(self, transfer_id: str) -> bool:
        return any(transfer_id in side.transfers for side in self._sides.values())

    def admit(self, request: Request, params: KVTransferParams) -> bool:
        request.transfer_id = params.transfer_id
        early = [msg for _, msg in self._early.pop(params.transfer_id, [])]
        return self._sides[params.role].admit(request, params, early, time.monotonic())

    # -- every step ------------------------------------------------------------------------

    def collect_events(self) -> ConnectorEvents:
        self.prefill.sweep_quarantine()
        for msg in self._worker.receive():
            if msg["t"] in PROBE_REPLIES:
                self.probes.receive(msg)
                continue
            found = self._route(msg["x"])
            if found is not None:
                found[0].receive(found[1], msg)
            elif msg["t"] not in ("ABORT", "ABORT_ACK"):
                # An ABORT for a transfer we never had needs no answer; an ABORT_ACK
                # answers a transfer that already ended here (e.g. refused, "decode full").
                self._early.setdefault(msg["x"], []).append((time.monotonic(), msg))
        now = time.monotonic()
        for side in self._sides.values():
            side.advance(now)
        self.probes.advance(now)
        for tid, early in list(self._early.items()):
            if now - early[0][0] > self.timeouts.done_s:
                del self._early[tid]
        return self._events.take()

    def _route(self, transfer_id: str) -> tuple[Side, Transfer] | None:
        """The side and transfer a message names: live transfers first, then kept ones."""
        for kept in (False, True):
            for side in self._sides.values():
                xfer = (side.quarantine if kept else side.transfers).get(transfer_id)
                if xfer is not None:
                    return side, xfer
        return None

    def layer_hook(self, batch_items: list[tuple[Request, int]]) -> LayerHook | None:
        return self._worker.layer_hook(self.prefill.plan_layerwise(batch_items))

    def prefill_done(self, request: Request, first_token: int) -> None:
        self.prefill.prefill_done(request, first_token, time.monotonic())

    # -- the end of a request ----------------------------------------------------------

    def request_finished(self, request: Request) -> bool:
        return any(side.request_finished(request) for side in self._sides.values())

    # -- state and shutdown ----------------------------------------------------------------

    @property
    def num_active(self) -> int:
        return sum(len(side.transfers) for side in self._sides.values())

    @property
    def num_pending(self) -> int:
        return (self.num_active + sum(len(side.quarantine) for side in self._sides.values())
                + self.probes.num_live)

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(x.request.block_table) for side in self._sides.values()
                   for x in side.quarantine.values())

    def stats(self) -> dict:
        t = self.transfer_stats
        return {
            **self.describe(),
            "num_kv_transfers_active": self.num_active,
            "num_kv_blocks_quarantined": self.num_quarantined_blocks,
            "kv_transfers_ok": t.num_ok, "kv_transfers_failed": t.num_failed,
            "kv_transfer_bytes": t.num_bytes, "kv_exposed_s_total": t.exposed_s_total,
        }

    def add_observer(self, observe) -> None:
        self._observers.append(observe)

    def close(self) -> None:
        self.probes.close()
        self._worker.close()
