"""The connector's one rule for blocks, on plain data: when a request ends it says once
whether freeing waits, and kept blocks come back through a single ``released`` event
that the scheduler frees. A fake worker stands in for the transport (no sockets)."""

from __future__ import annotations

from pdserve.api.sampling import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_transfer.dispatch import DispatchConnector
from pdserve.engine.kv_transfer.params import KVTransferParams
from pdserve.engine.kv_transfer.transport.base import BatchHandle
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler

PEER = "peer:1"
PROMPT = list(range(20))  # 3 blocks of 8


def no_stop(request, token) -> bool:
    return False


class FakeWorker:
    """Handshakes at once, records what is sent, hands each write a pending batch."""

    endpoint = "me:1"

    def __init__(self, can_fence: bool = False) -> None:
        self.can_fence = can_fence
        self.sent: list[str] = []
        self.inbox: list[dict] = []
        self.layout = type("Layout", (), {"num_layers": 2, "compat_hash": "h"})()

    def handshake(self, peer):
        return "ready"

    def send(self, peer, kind, **fields):
        self.sent.append(kind)

    def receive(self):
        msgs, self.inbox = self.inbox, []
        return msgs

    def deliver(self, kind, **fields):
        self.inbox.append({"t": kind, "from": PEER, "x": "x1", **fields})

    def queue_write(self, xfer, layers, start, end):
        xfer.handles.append(BatchHandle(PEER, 0, timeout_s=60))

    def grant_blocks(self, xfer):
        pass

    def revoke(self, xfer):
        return self.can_fence

    def layer_hook(self, plan):
        return None


def make(can_fence: bool = False):
    bm = BlockManager(num_blocks=8, block_size=8)
    worker = FakeWorker(can_fence)
    connector = DispatchConnector(worker, bm)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, connector=connector)
    return bm, worker, connector, scheduler


def leg(role: str, mode: str = "push") -> tuple[Request, KVTransferParams]:
    return Request(role, PROMPT, SamplingParams()), KVTransferParams(role, mode, "x1", PEER)


def test_prefill_aborted_with_a_write_in_flight_keeps_its_blocks_until_it_settles():
    bm, worker, connector, scheduler = make()
    request, params = leg("prefill")
    assert connector.admit(request, params)  # push: scheduled at once
    scheduler.add(request)
    batch = scheduler.schedule()
    connector.collect_events()  # handshake done
    worker.deliver("RESERVE", blocks=[0, 1, 2])
    connector.collect_events()
    scheduler.postprocess(batch, {"prefill": 7}, no_stop)  # first token: writes queued
    [handle] = connector.prefill.transfers["x1"].handles

    assert scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    assert "FAILED" in worker.sent
    assert bm.num_used_blocks == 3 and connector.num_pending == 1  # kept: a write may land
    assert connector.collect_events().released == []  # still in flight

    handle.finish()
    events = connector.collect_events()
    assert events.released == [request]
    assert scheduler.apply_kv_events(events, no_stop) == []  # the failure of a gone request
    assert bm.num_free_blocks == bm.num_blocks and connector.num_pending == 0


def test_decode_abort_after_reserve_waits_for_the_ack():
    bm, worker, connector, scheduler = make(can_fence=False)
    request, params = leg("decode")
    assert not connector.admit(request, params)
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    connector.collect_events()  # handshake, blocks reserved, RESERVE sent
    assert worker.sent == ["RESERVE"] and bm.num_used_blocks == 3

    assert scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    assert worker.sent[-1] == "ABORT" and bm.num_used_blocks == 3

    worker.deliver("ABORT_ACK")
    events = connector.collect_events()
    assert events.released == [request]
    scheduler.apply_kv_events(events, no_stop)
    assert bm.num_free_blocks == bm.num_blocks and connector.num_pending == 0


def test_decode_abort_frees_at_once_when_the_transport_fences_the_peer():
    bm, worker, connector, scheduler = make(can_fence=True)
    request, params = leg("decode")
    connector.admit(request, params)
    connector.collect_events()
    assert bm.num_used_blocks == 3
    assert scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    assert bm.num_free_blocks == bm.num_blocks and connector.num_pending == 0


def test_decode_exposes_with_the_first_token_and_a_handed_off_prefill_frees_on_finish():
    bm, worker, connector, scheduler = make()
    request, params = leg("decode")
    connector.admit(request, params)
    connector.collect_events()
    worker.deliver("DONE", token=5, seed=None, n=len(PROMPT))
    events = connector.collect_events()
    assert [(r, t) for r, t, _ in events.exposed] == [(request, 5)]
    [(changed, tokens)] = scheduler.apply_kv_events(events, no_stop)
    assert changed is request and tokens == [5] and request in scheduler.running
    assert request.num_computed_tokens == len(PROMPT)
    assert scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
    assert bm.num_free_blocks == bm.num_blocks and connector.num_pending == 0
