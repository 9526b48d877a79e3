"""Decode side of the KV connector: receives a request's KV from its prefill peer.

One ``DecodeTransfer`` per decode leg, a latched state machine with a deadline on
every waiting state (monotonic clock; ``done_s`` from admission):

    BOOTSTRAPPING ─handshake─▶ WAITING_FOR_INPUT
      push, layerwise: ─blocks reserved, RESERVE sent─▶ … ─DONE─▶ SUCCESS (request exposed)
      pull:            ─READY, blocks allocated─▶ TRANSFERRING (reading)
                       ─read done, RELEASE sent─▶ SUCCESS (request exposed)
    no blocks within reserve_wait_s ─▶ FAILED, is_full ("decode full")
    any waiting state past its deadline, an abort, P's FAILED/ABORT ─▶ FAILED,
      or ─▶ ABORTING (P may still write) ─ABORT_ACK, or the transport fenced P─▶ FAILED

Partial transfer: D allocates its destination with the prompt's leading blocks
taken from its own prefix cache (by block hash, shared by refcount) and says how
many in RESERVE (``skip``); P writes, or in pull mode D reads, only the tokens after
them, and D grants P writes into the other blocks only.

With ``decode_allocation=dispatch`` D reserves destination blocks as soon as the
peer is known; with ``prefill_complete`` it waits for P's WANT_DEST; in pull mode it
allocates on READY. Without free blocks it retries each step for at most
``reserve_wait_s`` from the first try that found none, then refuses: ABORT to P with
reason "decode full: ...", and the request ends ``FINISHED_FULL`` (load, not a
failure). Nothing was promised to P yet, so nothing is kept. Blocks the engine's
preempted streams need to come back and its queued local prefills need to start
(``BlockManager.owed_blocks``) do not count as free: a new transfer does not take
them; nor does it take a running slot (``max_num_seqs``) the scheduler's waiting
requests or the transfers reserved before it hold (``BlockManager.free_seats``).

Invariants:
- D exposes a request only after DONE, which P sends after every write settled DONE;
  the first token comes with DONE (or READY), so D streams it without a model step.
- D releases reserved blocks after a failure only when no write can land any more:
  P acknowledged the abort, the transport fenced the peer, or no byte was ever
  promised (no RESERVE sent). Otherwise they stay quarantined until P answers.
- D's deadline for DONE is longer than P's for RESERVE, so P gives up first.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pdserve.engine.kv_transfer.common import ENDED, Side, Transfer, XferState
from pdserve.engine.kv_transfer.messages import DECODE_FULL
from pdserve.engine.kv_transfer.params import KVTransferParams
from pdserve.engine.request import Request, RequestStatus

log = logging.getLogger(__name__)


@dataclass
class DecodeTransfer(Transfer):
    reserve_sent: bool = False  # a RESERVE promised P our blocks (writes may land)
    should_reserve: bool = False  # reserve destination blocks as soon as possible
    pending_ready: dict | None = None  # pull: READY waiting for handshake or free blocks
    seed: int | None = None  # pull: P's sampler seed, from READY
    no_room_since_s: float | None = None  # the first try to allocate that found no blocks


class DecodeSide(Side):
    partial = True  # take leading blocks from the prefix cache (set by DispatchConnector)

    def admit(self, request: Request, params: KVTransferParams, early: list[dict],
              now: float) -> bool:
        """The request waits for its KV; exposed later (never scheduled from here)."""
        xfer = DecodeTransfer(params, request, XferState.BOOTSTRAPPING, now + self.timeouts.done_s)
        xfer.should_reserve = params.mode != "pull" and self.decode_allocation == "dispatch"
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.register(xfer, early)
        return False

    # -- steps -------------------------------------------------------------------------

    def on_handshake(self, xfer: DecodeTransfer) -> None:
        pass  # drive reserves (or reads) in this same step

    def drive(self, xfer: DecodeTransfer, now: float) -> bool:
        if xfer.state is XferState.WAITING_FOR_INPUT:
            if xfer.should_reserve and not xfer.reserve_sent:
                self._try_reserve(xfer)
            if xfer.pending_ready is not None:
                self._on_ready(xfer, xfer.pending_ready)
        elif xfer.state is XferState.TRANSFERRING:
            self._check_read(xfer)
        elif xfer.state is XferState.ABORTING and now >= xfer.deadline:
            self._release_after_abort(xfer, acked=False)
            return True
        return False

    def on_message(self, xfer: DecodeTransfer, kind: str, msg: dict) -> bool:
        if kind == "ABORT_ACK" and xfer.state is XferState.ABORTING:
            self._release_after_abort(xfer, acked=True)
        elif xfer.state in ENDED:
            pass
        elif kind == "WANT_DEST":
            xfer.should_reserve = True
            if xfer.state is XferState.WAITING_FOR_INPUT:
                self._try_reserve(xfer)
        elif kind == "DONE" and xfer.params.mode != "pull":
            self._on_done(xfer, msg)
        elif kind == "READY" and xfer.params.mode == "pull":
            self._on_ready(xfer, msg)
        else:
            return False
        return True

    def on_peer_ended(self, xfer: DecodeTransfer, reason: str, is_full: bool) -> None:
        # P settled its writes before sending FAILED/ABORT: nothing more will land.
        self.fail(xfer, reason, notify_peer=False, write_may_land=False, is_full=is_full)

    def fail(self, xfer: DecodeTransfer, reason: str, notify_peer: bool,
             write_may_land: bool = True, *, is_full: bool = False) -> None:
        if xfer.state in ENDED:
            return
        xfer.error = reason
        xfer.is_full = is_full
        self.log_failed(xfer, reason)
        if notify_peer:
            self.send(xfer, "ABORT", reason=reason)
        if xfer.reserve_sent and self.worker.revoke(xfer):
            write_may_land = False  # the transport fenced this transfer's writes
        if xfer.reserve_sent and write_may_land:
            # P may still write into our blocks: keep them until it confirms.
            xfer.state = XferState.ABORTING
            xfer.deadline = time.monotonic() + self.timeouts.abort_ack_s
            self.report_failed(xfer, reason)
            return
        xfer.state = XferState.FAILED
        self.end(xfer, ok=False)
        self.report_failed(xfer, reason)

    # -- internals -----------------------------------------------------------------------

    def _try_reserve(self, xfer: DecodeTransfer) -> None:
        req = xfer.request
        if xfer.reserve_sent or self.worker.handshake(xfer.peer) != "ready":
            return
        if not self._allocate(xfer):
            return  # retried next step, for at most reserve_wait_s
        xfer.reserve_sent = True
        self.worker.grant_blocks(xfer)
        self.send(xfer, "RESERVE", blocks=req.block_table, skip=xfer.skip_blocks)

    def _allocate(self, xfer: DecodeTransfer) -> bool:
        """Allocate the request's destination blocks (all or nothing). Without room,
        refuse once ``reserve_wait_s`` passed since the first try that found none."""
        req, bm = xfer.request, self.block_manager
        hits = bm.find_cached_blocks(req) if self.partial else []
        n_hit = len(hits) * bm.block_size
        seated = self._num_seated() < bm.free_seats
        if seated and bm.allocate_slots(req, req.num_prompt_tokens - n_hit, cached_blocks=hits,
                                        keep_free=bm.owed_blocks):
            xfer.skip_blocks = len(hits)
            if self.partial:
                bm.record_prefix_query(req.num_prompt_tokens, n_hit)
            return True
        now = time.monotonic()
        if xfer.no_room_since_s is None:
            xfer.no_room_since_s = now
        wait_s = self.timeouts.reserve_wait_s
        if now - xfer.no_room_since_s >= wait_s:
            wanted = (f"{bm.num_blocks_for(req.num_prompt_tokens)} KV blocks wanted, "
                      f"{bm.num_free_blocks} free" if seated else "every running slot taken")
            self.fail(xfer, f"{DECODE_FULL}: {wanted} after {wait_s:g} s", notify_peer=True,
                      is_full=True)
        return False

    def _num_seated(self) -> int:
        """Transfers holding blocks for a stream that does not run yet: each takes a
        running slot once exposed."""
        return sum(1 for x in self.transfers.values()
                   if x.reserve_sent or x.state is XferState.TRANSFERRING)

    def _on_done(self, xfer: DecodeTransfer, msg: dict) -> None:
        if not xfer.reserve_sent:
            self.fail(xfer, "DONE before any destination was reserved", notify_peer=True)
            return
        token = msg.get("token")
        n = msg.get("n")
        if not isinstance(token, int) or n != xfer.request.num_prompt_tokens:
            self.fail(xfer, f"DONE with a bad state (token={token!r}, n={n!r})", notify_peer=True)
            return
        xfer.first_token = token
        xfer.request.kv_arrived_s = msg.get("rx_s")
        self._succeed(xfer, seed=msg.get("seed"))

    def _on_ready(self, xfer: DecodeTransfer, msg: dict) -> None:
        req = xfer.request
        blocks = msg.get("blocks") or []
        need = self.block_manager.num_blocks_for(req.num_prompt_tokens)
        if len(blocks) != need or msg.get("n") != req.num_prompt_tokens:
            self.fail(xfer, "READY with a bad descriptor", notify_peer=True)
            return
        xfer.pending_ready = msg
        if xfer.state is not XferState.WAITING_FOR_INPUT:
            return  # handshake pending: retried by drive
        if not self._allocate(xfer):
            return  # retried by drive, for at most reserve_wait_s
        xfer.pending_ready = None
        xfer.remote_blocks = blocks
        xfer.first_token = msg.get("token")
        xfer.seed = msg.get("seed")
        xfer.state = XferState.TRANSFERRING
        xfer.handles.append(self.worker.read(xfer, xfer.skip_blocks * self.block_manager.block_size,
                                             req.num_prompt_tokens))

    def _check_read(self, xfer: DecodeTransfer) -> None:
        settled, error = xfer.settled()
        if error:
            self.fail(xfer, f"reading KV from {xfer.peer} failed: {error}", notify_peer=True)
        elif settled:
            self.send(xfer, "RELEASE")
            self._succeed(xfer)

    def _succeed(self, xfer: DecodeTransfer, seed: int | None = None) -> None:
        if xfer.reserve_sent:
            self.worker.revoke(xfer)  # P settled every write before DONE: returns at once
        xfer.state = XferState.SUCCESS
        self.end(xfer, ok=True)
        seed = seed if seed is not None else xfer.seed
        self.events.exposed.append((xfer.request, xfer.first_token, seed))

    def _release_after_abort(self, xfer: DecodeTransfer, acked: bool) -> None:
        self.transfers.pop(xfer.transfer_id, None)
        if acked or self.worker.revoke(xfer):
            xfer.state = XferState.FAILED
            self.release(xfer)
        else:
            log.warning("transfer %s: no abort ack from %s; %d blocks quarantined until it answers",
                        xfer.transfer_id, xfer.peer, len(xfer.request.block_table))
            self.quarantine[xfer.transfer_id] = xfer
