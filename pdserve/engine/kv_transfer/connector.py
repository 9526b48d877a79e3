"""Scheduler half of the KV connector: which transfer does what, when, and when blocks free.

Runs on the engine thread; ``LLMEngine.step`` calls ``update`` once per step and
applies the returned ``ConnectorEvents``. One ``Transfer`` per request, a latched
state machine, a deadline on every waiting state (monotonic clock):

    P (send):    BOOTSTRAPPING ─RESERVE─▶ WAITING_FOR_INPUT (prefill running)
                 ─prefill done─▶ TRANSFERRING ─all writes settled─▶ SUCCESS (DONE sent)
                 pull: prefill done ─▶ TRANSFERRING (READY sent, lease) ─RELEASE─▶ SUCCESS
    D (receive): BOOTSTRAPPING ─blocks reserved, RESERVE sent─▶ WAITING_FOR_INPUT
                 ─DONE─▶ SUCCESS (request exposed);  pull: ─READY─▶ TRANSFERRING (read)
                 ─read done, RELEASE sent─▶ SUCCESS
    any waiting state past its deadline, an abort, a peer's FAILED/ABORT ─▶ FAILED

Invariants:
- P frees a request's blocks only when no write is queued or in flight (every
  batch settled), i.e. never before its writes completed.
- D exposes a request only after DONE, which P sends after every write settled DONE.
- D frees reserved blocks after a failure only when no write can land any more: P
  acknowledged the abort, the transport fenced the peer, or no byte was ever
  promised (no RESERVE sent). Otherwise the blocks stay quarantined.
- D's deadline for DONE is longer than P's for RESERVE, so P gives up first.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
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


@dataclass
class ConnectorTimeouts:
    descriptor_s: float = 10.0  # P: waiting for D's RESERVE once prefill is done
    done_s: float = 30.0  # D: waiting for DONE/READY from admission (longer than P's)
    lease_s: float = 30.0  # P (pull): holding prefilled blocks for D to read
    abort_ack_s: float = 5.0  # D: waiting for P to confirm an abort


@dataclass
class Transfer:
    params: KVTransferParams
    request: Request
    state: XferState
    deadline: float
    remote_blocks: list[int] | None = None
    sent_tokens: int = 0  # P layer-wise: tokens whose every layer is queued
    prefill_done_s: float | None = None
    first_token: int | None = None
    handles: list = field(default_factory=list)
    num_jobs_queued: int = 0
    cancelled: bool = False
    error: str | None = None
    reserve_sent: bool = False
    should_reserve: bool = False  # D: reserve destination blocks as soon as possible
    pending_ready: dict | None = None  # D (pull): READY waiting for handshake or free blocks
    seed: int | None = None
    holding: bool = False  # P (layer-wise): prefill waits until the destination is known
    lock: threading.Lock = field(default_factory=threading.Lock)
    started_s: float = field(default_factory=time.monotonic)
    num_bytes: int = 0

    @property
    def transfer_id(self) -> str:
        return self.params.transfer_id

    @property
    def peer(self) -> str:
        return self.params.peer

    def settled(self) -> tuple[bool, str | None]:
        """(every queued write submitted and settled, first failure message)."""
        with self.lock:
            if self.num_jobs_queued:
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


@dataclass
class ConnectorEvents:
    ready: list[Request] = field(default_factory=list)  # P: destination known, may prefill now
    exposed: list[tuple[Request, int, int | None]] = field(default_factory=list)  # D: (req, token, seed)
    handed_off: list[Request] = field(default_factory=list)  # P: done, blocks freed
    failed: list[tuple[Request, str]] = field(default_factory=list)


class KVConnector:
    def __init__(
        self,
        worker: ConnectorWorker,
        block_manager: BlockManager,
        timeouts: ConnectorTimeouts | None = None,
        decode_allocation: str = "dispatch",
        on_transfer_done=None,
    ) -> None:
        self.worker = worker
        self.block_manager = block_manager
        self.timeouts = timeouts or ConnectorTimeouts()
        self.decode_allocation = decode_allocation
        self.transfers: dict[str, Transfer] = {}
        self._early: dict[str, list[tuple[float, dict]]] = {}  # messages before admission
        self._quarantine: dict[str, Transfer] = {}
        # Observers of every finished transfer: callables (xfer, ok) -> None.
        self._observers = [on_transfer_done] if on_transfer_done is not None else []
        self._events = ConnectorEvents()

    def add_observer(self, observe) -> None:
        """Call ``observe(xfer, ok)`` for every finished transfer (metrics). Called once
        at start-up, before the engine thread runs."""
        self._observers.append(observe)

    # -- queries ---------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        return len(self.transfers)

    @property
    def num_pending(self) -> int:
        """Transfers and quarantined block sets that still need driving."""
        return len(self.transfers) + len(self._quarantine)

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(x.request.block_table) for x in self._quarantine.values())

    def plan_layerwise(self, batch_items) -> list[tuple[Transfer, int, int]]:
        """P: per-layer writes for this step, for layer-wise requests whose destination is known."""
        plan = []
        for request, num_new in batch_items:
            xfer = self.transfers.get(request.transfer_id or "")
            if xfer is None or xfer.params.mode != "layerwise" or xfer.params.role != "prefill":
                continue
            end = min(request.num_computed_tokens + num_new, request.num_prompt_tokens)
            if xfer.remote_blocks is not None and xfer.state is XferState.WAITING_FOR_INPUT:
                plan.append((xfer, xfer.sent_tokens, end))
                xfer.sent_tokens = end
        return plan

    # -- admission (engine thread) --------------------------------------------------------

    def admit(self, request: Request, params: KVTransferParams) -> None:
        now = time.monotonic()
        request.transfer_id = params.transfer_id
        if params.role == "prefill":
            # No deadline while prefill runs; it starts when the first token exists.
            xfer = Transfer(params, request, XferState.BOOTSTRAPPING, deadline=float("inf"))
            request.pinned = True  # never preempted: its blocks may be in flight
            if self.holds_prefill(params):
                # Layer-wise writes need the destination before the first layer is
                # computed: the prefill waits (bounded) for D's RESERVE, as SGLang's
                # bootstrap queue does.
                xfer.holding = True
                xfer.deadline = now + self.timeouts.descriptor_s
        else:
            xfer = Transfer(params, request, XferState.BOOTSTRAPPING, now + self.timeouts.done_s)
            xfer.should_reserve = params.mode != "pull" and self.decode_allocation == "dispatch"
        self.transfers[params.transfer_id] = xfer
        self.worker.handshake(params.peer)
        for _, msg in self._early.pop(params.transfer_id, []):
            self._on_message(xfer, msg)

    def holds_prefill(self, params: KVTransferParams) -> bool:
        """Whether a prefill leg must wait for its destination before being scheduled."""
        return (params.role == "prefill" and params.mode == "layerwise"
                and self.decode_allocation == "dispatch")

    def _release_prefill(self, xfer: Transfer) -> None:
        if xfer.holding and xfer.remote_blocks is not None and xfer.state is XferState.WAITING_FOR_INPUT:
            xfer.holding = False
            xfer.deadline = float("inf")
            self._events.ready.append(xfer.request)

    def on_prefill_done(self, request: Request, first_token: int) -> None:
        """P: the prefill step sampled the first token; the request left the running set."""
        xfer = self.transfers[request.transfer_id]
        now = time.monotonic()
        xfer.prefill_done_s = now
        xfer.first_token = first_token
        if xfer.params.mode == "pull":
            xfer.deadline = now + self.timeouts.lease_s
        else:
            xfer.deadline = now + self.timeouts.descriptor_s
        if xfer.state is not XferState.BOOTSTRAPPING:
            self._after_prefill(xfer)
        # else: the handshake's completion in _advance continues from here

    def _after_prefill(self, xfer: Transfer) -> None:
        """P: prefill done and the peer is known compatible."""
        if xfer.params.mode == "pull":
            xfer.state = XferState.TRANSFERRING
            self._send_ready(xfer)
        elif xfer.remote_blocks is not None:
            self._start_push(xfer)
        elif self.decode_allocation == "prefill_complete":
            self._send(xfer, "WANT_DEST")
        # else: writes start when RESERVE arrives

    def abort(self, request: Request, reason: str) -> None:
        """The request is going away (client abort); end its transfer safely. Idempotent."""
        xfer = self.transfers.get(request.transfer_id or "")
        if xfer is not None and xfer.request is request:
            self._fail(xfer, reason, notify_peer=True)

    # -- the per-step update ----------------------------------------------------------

    def owns(self, request: Request) -> bool:
        """True while the connector decides when ``request``'s blocks are freed."""
        tid = request.transfer_id
        return tid is not None and (
            (tid in self.transfers and self.transfers[tid].request is request)
            or tid in self._quarantine
        )

    def update(self) -> ConnectorEvents:
        """Called by the engine at the start of every step; returns what changed."""
        events = self._events  # everything raised since the last update, and during this one
        self.sweep_quarantine()
        for msg in self.worker.receive():
            xfer = self.transfers.get(msg["x"]) or self._quarantine.get(msg["x"])
            if xfer is None:
                if msg["t"] == "ABORT":
                    continue
                self._early.setdefault(msg["x"], []).append((time.monotonic(), msg))
                continue
            self._on_message(xfer, msg)
        now = time.monotonic()
        for xfer in list(self.transfers.values()):
            self._advance(xfer, now)
        for tid, early in list(self._early.items()):
            if now - early[0][0] > self.timeouts.done_s:
                del self._early[tid]
        self._events = ConnectorEvents()
        return events

    def _advance(self, xfer: Transfer, now: float) -> None:
        p = xfer.params
        if xfer.state is XferState.BOOTSTRAPPING:
            status = self.worker.handshake(p.peer)
            if status not in (None, "ready"):
                self._fail(xfer, status, notify_peer=False)
                return
            if status == "ready":
                xfer.state = XferState.WAITING_FOR_INPUT
                if p.role == "prefill" and xfer.prefill_done_s is not None:
                    self._after_prefill(xfer)
                self._release_prefill(xfer)
        if xfer.state is XferState.WAITING_FOR_INPUT and p.role == "decode":
            if xfer.should_reserve and not xfer.reserve_sent:
                self._try_reserve(xfer)
            if xfer.pending_ready is not None:
                self._on_ready(xfer, xfer.pending_ready)
        elif xfer.state is XferState.TRANSFERRING:
            self._check_progress(xfer)
        elif xfer.state is XferState.ABORTING and now >= xfer.deadline:
            self._release_after_abort(xfer, acked=False)
            return
        if xfer.state not in (XferState.SUCCESS, XferState.FAILED, XferState.ABORTING) and now >= xfer.deadline:
            self._fail(xfer, f"transfer timed out in state {xfer.state.value}", notify_peer=True)

    def _check_progress(self, xfer: Transfer) -> None:
        if xfer.params.mode == "pull":
            if xfer.params.role == "decode":  # D reading
                settled, error = xfer.settled()
                if error:
                    self._fail(xfer, f"reading KV from {xfer.peer} failed: {error}", notify_peer=True)
                elif settled:
                    self._send(xfer, "RELEASE")
                    self._succeed_decode(xfer)
            return  # P in pull waits for RELEASE
        settled, error = xfer.settled()
        if not settled:
            return
        if error:
            self._fail(xfer, f"writing KV to {xfer.peer} failed: {error}", notify_peer=True)
            return
        req = xfer.request
        self._send(xfer, "DONE", token=xfer.first_token, seed=req.sampling_params.seed,
                   n=req.num_prompt_tokens)
        self._succeed_prefill(xfer)

    # -- messages ---------------------------------------------------------------------

    def _on_message(self, xfer: Transfer, msg: dict) -> None:
        kind = msg["t"]
        p = xfer.params
        if msg["from"] != p.peer:
            log.warning("transfer %s: %s from unexpected peer %s", p.transfer_id, kind, msg["from"])
            return
        if kind == "ABORT_ACK" and xfer.state is XferState.ABORTING:
            self._release_after_abort(xfer, acked=True)
        elif kind in ("ABORT", "FAILED"):
            reason = f"peer {p.peer} {'aborted' if kind == 'ABORT' else 'failed'}: {msg.get('reason', '')}"
            if p.role == "prefill":
                self._fail(xfer, reason, notify_peer=False)
                self._send(xfer, "ABORT_ACK")
            else:
                # P settled its writes before sending FAILED/ABORT: nothing more will land.
                self._fail(xfer, reason, notify_peer=False, write_may_land=False)
        elif xfer.state in (XferState.SUCCESS, XferState.FAILED, XferState.ABORTING):
            return
        elif p.role == "prefill" and kind == "RESERVE":
            self._on_reserve(xfer, msg)
        elif p.role == "prefill" and kind == "RELEASE" and p.mode == "pull":
            self._succeed_prefill(xfer)
        elif p.role == "decode" and kind == "WANT_DEST":
            xfer.should_reserve = True
            if xfer.state is XferState.WAITING_FOR_INPUT:
                self._try_reserve(xfer)
        elif p.role == "decode" and kind == "DONE" and p.mode != "pull":
            self._on_done(xfer, msg)
        elif p.role == "decode" and kind == "READY" and p.mode == "pull":
            self._on_ready(xfer, msg)
        else:
            log.warning("transfer %s: unexpected %s in state %s", p.transfer_id, kind, xfer.state.value)

    def _on_reserve(self, xfer: Transfer, msg: dict) -> None:
        blocks = msg.get("blocks") or []
        need = self.block_manager.num_blocks_for(xfer.request.num_prompt_tokens)
        if len(blocks) != need:
            self._fail(xfer, f"RESERVE names {len(blocks)} blocks, {need} needed", notify_peer=True)
            return
        xfer.remote_blocks = blocks
        self._release_prefill(xfer)
        if xfer.state is XferState.WAITING_FOR_INPUT and xfer.prefill_done_s is not None:
            self._start_push(xfer)
        # else: layer-wise writes start with the next step; the rest after prefill

    def _on_done(self, xfer: Transfer, msg: dict) -> None:
        if not xfer.reserve_sent:
            self._fail(xfer, "DONE before any destination was reserved", notify_peer=True)
            return
        token = msg.get("token")
        n = msg.get("n")
        if not isinstance(token, int) or n != xfer.request.num_prompt_tokens:
            self._fail(xfer, f"DONE with a bad state (token={token!r}, n={n!r})", notify_peer=True)
            return
        xfer.first_token = token
        xfer.request.kv_arrived_s = msg.get("rx_s")
        self._succeed_decode(xfer, seed=msg.get("seed"))

    def _on_ready(self, xfer: Transfer, msg: dict) -> None:
        req = xfer.request
        blocks = msg.get("blocks") or []
        need = self.block_manager.num_blocks_for(req.num_prompt_tokens)
        if len(blocks) != need or msg.get("n") != req.num_prompt_tokens:
            self._fail(xfer, "READY with a bad descriptor", notify_peer=True)
            return
        xfer.pending_ready = msg
        if xfer.state is not XferState.WAITING_FOR_INPUT:
            return  # handshake pending: retried by _advance
        if not self.block_manager.allocate_slots(req, req.num_prompt_tokens):
            return  # no room yet: retried next step, until the deadline
        xfer.pending_ready = None
        xfer.remote_blocks = blocks
        xfer.first_token = msg.get("token")
        xfer.seed = msg.get("seed")
        xfer.state = XferState.TRANSFERRING
        xfer.handles.append(self.worker.read(xfer, 0, req.num_prompt_tokens))

    # -- actions ------------------------------------------------------------------------

    def _send(self, xfer: Transfer, kind: str, **fields) -> None:
        self.worker.send(xfer.peer, kind, x=xfer.transfer_id, **fields)

    def _send_ready(self, xfer: Transfer) -> None:
        req = xfer.request
        self._send(xfer, "READY", blocks=req.block_table, token=xfer.first_token,
                   seed=req.sampling_params.seed, n=req.num_prompt_tokens)

    def _try_reserve(self, xfer: Transfer) -> None:
        req = xfer.request
        if xfer.reserve_sent or self.worker.handshake(xfer.peer) != "ready":
            return
        if not self.block_manager.allocate_slots(req, req.num_prompt_tokens):
            return  # retried next step until the deadline
        xfer.reserve_sent = True
        self.worker.grant_blocks(xfer)
        self._send(xfer, "RESERVE", blocks=req.block_table)

    def _start_push(self, xfer: Transfer) -> None:
        """P: prefill done and destination known; queue what is not yet queued."""
        xfer.state = XferState.TRANSFERRING
        self.worker.queue_write(xfer, range(self.worker.layout.num_layers), xfer.sent_tokens,
                                xfer.request.num_prompt_tokens)
        xfer.sent_tokens = xfer.request.num_prompt_tokens

    def _succeed_prefill(self, xfer: Transfer) -> None:
        xfer.state = XferState.SUCCESS
        self.block_manager.free(xfer.request)  # every write settled (or D released)
        self._finish(xfer, ok=True)
        self._events.handed_off.append(xfer.request)

    def _succeed_decode(self, xfer: Transfer, seed=None) -> None:
        if xfer.reserve_sent:
            self.worker.revoke(xfer)  # P settled every write before DONE: returns at once
        xfer.state = XferState.SUCCESS
        self._finish(xfer, ok=True)
        seed = seed if seed is not None else xfer.seed
        self._events.exposed.append((xfer.request, xfer.first_token, seed))

    def _fail(self, xfer: Transfer, reason: str, notify_peer: bool, write_may_land: bool = True) -> None:
        if xfer.state in (XferState.SUCCESS, XferState.FAILED, XferState.ABORTING):
            return
        log.warning("transfer %s (%s) failed: %s", xfer.transfer_id, xfer.params.role, reason)
        xfer.cancelled = True
        xfer.error = reason
        p = xfer.params
        if notify_peer:
            self._send(xfer, "ABORT" if p.role == "decode" else "FAILED", reason=reason)
        if p.role == "decode" and xfer.reserve_sent and self.worker.revoke(xfer):
            write_may_land = False  # the transport fenced this transfer's writes
        if p.role == "decode" and xfer.reserve_sent and write_may_land:
            # P may still write into our blocks: keep them until it confirms.
            xfer.state = XferState.ABORTING
            xfer.deadline = time.monotonic() + self.timeouts.abort_ack_s
            self._events.failed.append((xfer.request, reason))
            return
        xfer.state = XferState.FAILED
        if p.role == "prefill" and not xfer.settled()[0]:
            self._quarantine[xfer.transfer_id] = xfer  # freed by sweep once writes settle
        else:
            self.block_manager.free(xfer.request)
        self._finish(xfer, ok=False)
        self._events.failed.append((xfer.request, reason))

    def _release_after_abort(self, xfer: Transfer, acked: bool) -> None:
        self.transfers.pop(xfer.transfer_id, None)
        if acked or self.worker.revoke(xfer):
            xfer.state = XferState.FAILED
            self._quarantine.pop(xfer.transfer_id, None)
            self.block_manager.free(xfer.request)
        else:
            log.warning("transfer %s: no abort ack from %s; %d blocks quarantined until it answers",
                        xfer.transfer_id, xfer.peer, len(xfer.request.block_table))
            self._quarantine[xfer.transfer_id] = xfer

    def _finish(self, xfer: Transfer, ok: bool) -> None:
        self.transfers.pop(xfer.transfer_id, None)
        for observe in self._observers:
            observe(xfer, ok)

    def sweep_quarantine(self) -> None:
        """Free P-side blocks whose writes have settled since the transfer failed."""
        for tid, xfer in list(self._quarantine.items()):
            if xfer.params.role == "prefill" and xfer.settled()[0]:
                del self._quarantine[tid]
                self.block_manager.free(xfer.request)
