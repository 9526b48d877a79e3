"""What the prefill and decode sides share: states, deadlines, the transfer record's
base, and the per-transfer driving both sides follow.

Each side keeps its live transfers (one per request, a latched state machine; every
waiting state has a deadline on the monotonic clock) and its quarantine: transfers
that ended while a write could still land, whose blocks wait for a ``released``
event. Both run on the engine thread; only ``Transfer.lock`` guards what the
worker's sender thread also touches.

A transfer that ends because D had no blocks for it (``Transfer.is_full``: D gave up
reserving after ``reserve_wait_s``, or P heard so in D's ABORT) is load, not a
failure: it is raised as ``full`` instead of ``failed`` and its request ends
``FINISHED_FULL`` ("decode full"). A transfer whose request was aborted by its
client (the Coordinator cancelling a leg: D refused it, the client left, a stop
string) is cancelled (``Transfer.is_cancelled``, on this side and, through the
ABORT or FAILED reason, on the peer's): logged at INFO and counted apart, not as a failure.
"""

from __future__ import annotations

import abc
import enum
import logging
import threading
import time
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_transfer.base import ConnectorEvents
from pdserve.engine.kv_transfer.messages import CANCELLED, DECODE_FULL
from pdserve.engine.kv_transfer.params import KVTransferParams
from pdserve.engine.kv_transfer.worker import ConnectorWorker
from pdserve.engine.request import Request

log = logging.getLogger(__name__)


class XferState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    ABORTING = "aborting"  # D: waiting for P's ABORT_ACK before freeing
    SUCCESS = "success"
    FAILED = "failed"


ENDED = (XferState.SUCCESS, XferState.FAILED, XferState.ABORTING)  # no more protocol steps


@dataclass
class ConnectorTimeouts:
    descriptor_s: float = 10.0  # P: waiting for D's RESERVE once prefill is done
    done_s: float = 30.0  # D: waiting for DONE/READY from admission (longer than P's)
    lease_s: float = 30.0  # P (pull): holding prefilled blocks for D to read
    abort_ack_s: float = 5.0  # D: waiting for P to confirm an abort
    # D: waiting for free blocks to reserve (from the first try that found none), then
    # "decode full"; shorter than P's descriptor_s, so P hears of it before giving up.
    reserve_wait_s: float = 2.0


@dataclass
class Transfer:
    """One request's transfer, either side. Subclasses add each side's own state."""

    params: KVTransferParams
    request: Request
    state: XferState
    deadline: float
    remote_blocks: list[int] | None = None  # the peer's blocks for this request
    # Leading blocks D took from its prefix cache: not moved (the peer's RESERVE says so).
    skip_blocks: int = 0
    first_token: int | None = None
    handles: list = field(default_factory=list)  # submitted batches (sender thread appends on P)
    error: str | None = None
    is_full: bool = False  # ended for want of D's blocks: load, not a failure
    is_cancelled: bool = False  # ended because its request was aborted: not a failure
    lock: threading.Lock = field(default_factory=threading.Lock)
    started_s: float = field(default_factory=time.monotonic)

    @property
    def transfer_id(self) -> str:
        return self.params.transfer_id

    @property
    def peer(self) -> str:
        return self.params.peer

    def has_queued_jobs(self) -> bool:
        """Writes queued but not yet submitted (P); called under ``lock``."""
        return False

    def settled(self) -> tuple[bool, str | None]:
        """(every queued write submitted and settled, first failure message)."""
        with self.lock:
            if self.has_queued_jobs():
                return False, self.error
            handles = list(self.handles)
            error = self.error
        for h in handles:
            status = h.status()
            if status.is_pending:
                return False, error
            if status.is_failed and error is None:
                error = status.message
        return True, error


class Side(abc.ABC):
    """The driving both sides share; ``PrefillSide`` and ``DecodeSide`` fill in the steps.

    Called by ``DispatchConnector`` only, on the engine thread.
    """

    def __init__(self, worker: ConnectorWorker, block_manager: BlockManager,
                 timeouts: ConnectorTimeouts, decode_allocation: str, events: ConnectorEvents,
                 observers: list) -> None:
        self.worker = worker
        self.block_manager = block_manager
        self.timeouts = timeouts
        self.decode_allocation = decode_allocation
        self.events = events  # shared with the other side; drained by collect_events
        self.observers = observers
        self.transfers: dict[str, Transfer] = {}
        self.quarantine: dict[str, Transfer] = {}

    # -- queries ---------------------------------------------------------------------

    def find(self, request: Request) -> Transfer | None:
        """The live transfer of this very request object, if any."""
        xfer = self.transfers.get(request.transfer_id or "")
        return xfer if xfer is not None and xfer.request is request else None

    def holds(self, request: Request) -> bool:
        """Whether this side still decides when ``request``'s blocks are freed."""
        kept = self.quarantine.get(request.transfer_id or "")
        return self.find(request) is not None or (kept is not None and kept.request is request)

    # -- lifecycle ---------------------------------------------------------------------

    def register(self, xfer: Transfer, early: list[dict]) -> None:
        """Start driving ``xfer``: say HELLO to its peer once, replay early messages."""
        self.transfers[xfer.transfer_id] = xfer
        self.worker.handshake(xfer.peer)
        for msg in early:
            self.receive(xfer, msg)

    def request_finished(self, request: Request) -> bool:
        """See ``KVConnector.request_finished``: aborts a live transfer, then says whether
        the blocks are kept."""
        xfer = self.find(request)
        if xfer is not None:
            xfer.is_cancelled = request.error is None  # aborted by its client, not failed
            self.fail(xfer, request.error or f"{CANCELLED}: the request was aborted", notify_peer=True)
        return self.holds(request)

    def advance(self, now: float) -> None:
        """Every step: handshakes, side-specific progress, deadlines."""
        for xfer in list(self.transfers.values()):
            if xfer.state is XferState.BOOTSTRAPPING:
                status = self.worker.handshake(xfer.peer)
                if status not in (None, "ready"):
                    self.fail(xfer, status, notify_peer=False)
                    continue
                if status == "ready":
                    xfer.state = XferState.WAITING_FOR_INPUT
                    self.on_handshake(xfer)
            if self.drive(xfer, now):
                continue
            if xfer.state not in ENDED and now >= xfer.deadline:
                self.fail(xfer, f"transfer timed out in state {xfer.state.value}", notify_peer=True)

    def receive(self, xfer: Transfer, msg: dict) -> None:
        """A control message for ``xfer`` (live or quarantined)."""
        kind = msg["t"]
        if msg["from"] != xfer.peer:
            log.warning("transfer %s: %s from unexpected peer %s", xfer.transfer_id, kind, msg["from"])
            return
        if kind in ("ABORT", "FAILED"):
            reason = str(msg.get("reason", ""))
            if kind == "ABORT" and reason.startswith(DECODE_FULL):
                self.on_peer_ended(xfer, f"{DECODE_FULL} (peer {xfer.peer})", is_full=True)
            else:
                verb = "aborted" if kind == "ABORT" else "failed"
                xfer.is_cancelled = reason.startswith(CANCELLED)
                self.on_peer_ended(xfer, f"peer {xfer.peer} {verb}: {reason}", is_full=False)
        elif not self.on_message(xfer, kind, msg):
            log.warning("transfer %s: unexpected %s in state %s", xfer.transfer_id, kind,
                        xfer.state.value)

    # -- for the sides ---------------------------------------------------------------------

    def send(self, xfer: Transfer, kind: str, **fields) -> None:
        self.worker.send(xfer.peer, kind, x=xfer.transfer_id, **fields)

    def end(self, xfer: Transfer, ok: bool) -> None:
        """The transfer is over (its blocks may still be kept): tell the observers."""
        self.transfers.pop(xfer.transfer_id, None)
        for observe in self.observers:
            observe(xfer, ok)

    def release(self, xfer: Transfer) -> None:
        """The one path by which kept blocks go back: a ``released`` event."""
        self.quarantine.pop(xfer.transfer_id, None)
        self.events.released.append(xfer.request)

    def report_failed(self, xfer: Transfer, reason: str) -> None:
        """Raise the event of a transfer that ended badly: ``full`` for want of D's
        blocks (load), ``failed`` otherwise. Called once, from ``fail``."""
        (self.events.full if xfer.is_full else self.events.failed).append((xfer.request, reason))

    def log_failed(self, xfer: Transfer, reason: str) -> None:
        if xfer.is_full:  # load: the Coordinator sends the request elsewhere or waits
            log.info("transfer %s (%s) refused: %s", xfer.transfer_id, xfer.params.role, reason)
        elif xfer.is_cancelled:
            log.info("transfer %s (%s) cancelled: %s", xfer.transfer_id, xfer.params.role, reason)
        else:
            log.warning("transfer %s (%s) failed: %s", xfer.transfer_id, xfer.params.role, reason)

    @abc.abstractmethod
    def on_handshake(self, xfer: Transfer) -> None:
        """The peer's layout is known compatible (state is now WAITING_FOR_INPUT)."""

    @abc.abstractmethod
    def admit(self, request: Request, params: KVTransferParams, early: list[dict],
              now: float) -> bool:
        """Create and register the request's transfer; True when it may be scheduled now."""

    @abc.abstractmethod
    def drive(self, xfer: Transfer, now: float) -> bool:
        """One step of progress; True when ``xfer`` left this side's transfers for good."""

    @abc.abstractmethod
    def on_message(self, xfer: Transfer, kind: str, msg: dict) -> bool:
        """A protocol message other than ABORT/FAILED; False when unexpected."""

    @abc.abstractmethod
    def on_peer_ended(self, xfer: Transfer, reason: str, is_full: bool) -> None:
        """The peer sent ABORT or FAILED; ``is_full`` when D's ABORT said "decode full"."""

    @abc.abstractmethod
    def fail(self, xfer: Transfer, reason: str, notify_peer: bool, *, is_full: bool = False) -> None:
        """End ``xfer`` with an error (no-op once ended); keeps its blocks while a write
        may land, and raises ``failed`` (``full`` with ``is_full``: D had no blocks)."""
