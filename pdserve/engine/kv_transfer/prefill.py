"""Prefill side of the KV connector: sends a prefilled request's KV to its decode peer.

One ``PrefillTransfer`` per prefill leg, a latched state machine with a deadline on
every waiting state (monotonic clock; none while the prefill itself runs):

    BOOTSTRAPPING ─handshake─▶ WAITING_FOR_INPUT (prefill running)
      push, layerwise: ─RESERVE (its ``skip``: D's cached leading blocks, not sent)
                       and prefill done─▶ TRANSFERRING ─every write settled─▶
                       SUCCESS (DONE sent)
      pull:            ─prefill done─▶ TRANSFERRING (READY sent, lease) ─RELEASE─▶ SUCCESS
    any waiting state past its deadline, an abort, D's ABORT/FAILED ─▶ FAILED
      (D's ABORT "decode full ...": FAILED, is_full; the request ends "decode full")

Layer-wise with ``decode_allocation=dispatch`` *holds* the prefill: the request is
not scheduled until D's RESERVE names the destination (bounded by ``descriptor_s``,
like SGLang's bootstrap queue), then each layer's writes are queued as soon as the
model computed it. With ``prefill_complete`` P asks for the destination (WANT_DEST)
once prefill is done.

Invariants:
- A prefill leg is pinned: never preempted, since its blocks may be in flight.
- P keeps a request's blocks while a write is queued or in flight (not every batch
  settled), i.e. never frees them before its writes completed: a failed transfer
  with writes outstanding is quarantined and released once they settle.
- DONE is sent only after every write settled DONE, so D never exposes partial KV.
- P's deadline for RESERVE is shorter than D's for DONE, so P gives up first.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.kv_transfer.common import ENDED, Side, Transfer, XferState
from pdserve.engine.kv_transfer.params import KVTransferParams
from pdserve.engine.request import Request


@dataclass
class PrefillTransfer(Transfer):
    sent_tokens: int = 0  # layer-wise: tokens whose every layer is queued
    prefill_done_s: float | None = None
    num_jobs_queued: int = 0  # write jobs queued, not yet submitted (under lock)
    cancelled: bool = False  # the sender thread drops queued jobs
    holding: bool = False  # the prefill waits until the destination is known

    def has_queued_jobs(self) -> bool:
        return self.num_jobs_queued > 0


class PrefillSide(Side):
    def admit(self, request: Request, params: KVTransferParams, early: list[dict],
              now: float) -> bool:
        """Returns True when the request may be scheduled now (not held)."""
        # No deadline while prefill runs; it starts when the first token exists.
        xfer = PrefillTransfer(params, request, XferState.BOOTSTRAPPING, deadline=float("inf"))
        request.pinned = True  # never preempted: its blocks may be in flight
        if params.mode == "layerwise" and self.decode_allocation == "dispatch":
            # Layer-wise writes need the destination before the first layer is computed.
            xfer.holding = True
            xfer.deadline = now + self.timeouts.descriptor_s
        schedule_now = not xfer.holding
        self.register(xfer, early)
        return schedule_now

    def plan_layerwise(self, batch_items) -> list[tuple[PrefillTransfer, int, int]]:
        """Per-layer writes for this step, for layer-wise requests whose destination is known."""
        plan = []
        for request, num_new in batch_items:
            xfer = self.transfers.get(request.transfer_id or "")
            if xfer is None or xfer.params.mode != "layerwise":
                continue
            end = min(request.num_computed_tokens + num_new, request.num_prompt_tokens)
            if (xfer.remote_blocks is not None and xfer.state is XferState.WAITING_FOR_INPUT
                    and end > xfer.sent_tokens):  # not within D's cached blocks
                plan.append((xfer, xfer.sent_tokens, end))
                xfer.sent_tokens = end
        return plan

    def prefill_done(self, request: Request, first_token: int, now: float) -> None:
        xfer = self.transfers[request.transfer_id]
        xfer.prefill_done_s = now
        xfer.first_token = first_token
        if xfer.params.mode == "pull":
            xfer.deadline = now + self.timeouts.lease_s
        else:
            xfer.deadline = now + self.timeouts.descriptor_s
        if xfer.state is not XferState.BOOTSTRAPPING:
            self._after_prefill(xfer)
        # else: the handshake's completion (on_handshake) continues from here

    def sweep_quarantine(self) -> None:
        """Release blocks whose writes have settled since the transfer failed."""
        for xfer in list(self.quarantine.values()):
            if xfer.settled()[0]:
                self.release(xfer)

    # -- steps -------------------------------------------------------------------------

    def on_handshake(self, xfer: PrefillTransfer) -> None:
        if xfer.prefill_done_s is not None:
            self._after_prefill(xfer)
        self._release_hold(xfer)

    def drive(self, xfer: PrefillTransfer, now: float) -> bool:
        if xfer.state is XferState.TRANSFERRING and xfer.params.mode != "pull":
            self._check_writes(xfer)
        # pull: TRANSFERRING waits for RELEASE
        return False

    def on_message(self, xfer: PrefillTransfer, kind: str, msg: dict) -> bool:
        if xfer.state in ENDED:
            return True
        if kind == "RESERVE":
            self._on_reserve(xfer, msg)
        elif kind == "RELEASE" and xfer.params.mode == "pull":
            self._succeed(xfer)
        else:
            return False
        return True

    def on_peer_ended(self, xfer: PrefillTransfer, reason: str, is_full: bool) -> None:
        self.fail(xfer, reason, notify_peer=False, is_full=is_full)
        self.send(xfer, "ABORT_ACK")  # D's writes can no longer come from us: it may free

    def fail(self, xfer: PrefillTransfer, reason: str, notify_peer: bool, *,
             is_full: bool = False) -> None:
        if xfer.state in ENDED:
            return
        xfer.cancelled = True
        xfer.error = reason
        xfer.is_full = is_full
        self.log_failed(xfer, reason)
        if notify_peer:
            self.send(xfer, "FAILED", reason=reason)
        xfer.state = XferState.FAILED
        if not xfer.settled()[0]:
            self.quarantine[xfer.transfer_id] = xfer  # released by the sweep once writes settle
        self.end(xfer, ok=False)
        self.report_failed(xfer, reason)

    # -- internals -----------------------------------------------------------------------

    def _release_hold(self, xfer: PrefillTransfer) -> None:
        if xfer.holding and xfer.remote_blocks is not None and xfer.state is XferState.WAITING_FOR_INPUT:
            xfer.holding = False
            xfer.deadline = float("inf")
            self.events.ready.append(xfer.request)

    def _after_prefill(self, xfer: PrefillTransfer) -> None:
        """Prefill done and the peer is known compatible."""
        if xfer.params.mode == "pull":
            xfer.state = XferState.TRANSFERRING
            req = xfer.request
            self.send(xfer, "READY", blocks=req.block_table, token=xfer.first_token,
                      seed=req.sampling_params.seed, n=req.num_prompt_tokens)
        elif xfer.remote_blocks is not None:
            self._start_push(xfer)
        elif self.decode_allocation == "prefill_complete":
            self.send(xfer, "WANT_DEST")
        # else: writes start when RESERVE arrives

    def _on_reserve(self, xfer: PrefillTransfer, msg: dict) -> None:
        blocks = msg.get("blocks") or []
        n, bs = xfer.request.num_prompt_tokens, self.block_manager.block_size
        need = self.block_manager.num_blocks_for(n)
        if len(blocks) != need:
            self.fail(xfer, f"RESERVE names {len(blocks)} blocks, {need} needed", notify_peer=True)
            return
        skip = msg.get("skip", 0)
        if type(skip) is not int or not 0 <= skip * bs < n:  # D computes at least the last token
            self.fail(xfer, f"RESERVE skips {skip!r} of {need} blocks", notify_peer=True)
            return
        xfer.remote_blocks = blocks
        xfer.skip_blocks = skip
        xfer.sent_tokens = skip * bs  # D holds those already
        self._release_hold(xfer)
        if xfer.state is XferState.WAITING_FOR_INPUT and xfer.prefill_done_s is not None:
            self._start_push(xfer)
        # else: layer-wise writes start with the next step; the rest after prefill

    def _start_push(self, xfer: PrefillTransfer) -> None:
        """Prefill done and destination known; queue what is not yet queued."""
        xfer.state = XferState.TRANSFERRING
        self.worker.queue_write(xfer, range(self.worker.layout.num_layers), xfer.sent_tokens,
                                xfer.request.num_prompt_tokens)
        xfer.sent_tokens = xfer.request.num_prompt_tokens

    def _check_writes(self, xfer: PrefillTransfer) -> None:
        settled, error = xfer.settled()
        if not settled:
            return
        if error:
            self.fail(xfer, f"writing KV to {xfer.peer} failed: {error}", notify_peer=True)
            return
        req = xfer.request
        self.send(xfer, "DONE", token=xfer.first_token, seed=req.sampling_params.seed,
                  n=req.num_prompt_tokens)
        self._succeed(xfer)

    def _succeed(self, xfer: PrefillTransfer) -> None:
        xfer.state = XferState.SUCCESS  # every write settled (or D released): blocks free now
        self.end(xfer, ok=True)
        self.events.handed_off.append(xfer.request)
