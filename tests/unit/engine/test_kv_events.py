"""The prefix cache's event log: snapshots for new readers, deltas (net changes) for
readers that resume, a snapshot again after a restart (new epoch) or when the events
a reader missed are no longer kept, and one wake-up per burst."""

from __future__ import annotations

from pdserve.api.sampling import SamplingParams
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.request import Request
from pdserve.runtime.block_hash import hash_chain

H = [bytes([i]) * 16 for i in range(8)]


def test_new_reader_gets_a_snapshot_then_net_changes_then_nothing():
    log = KVEventLog()
    wakes = []
    reader = log.subscribe(lambda: wakes.append(1))
    log.stored(H[0])
    log.stored(H[1])
    first = log.read(reader, "", 0)
    assert first.snapshot and sorted(first.stored) == [H[0], H[1]] and first.seq == 2
    assert log.read(reader, first.epoch, first.seq) is None  # idle: woken by the next event
    log.removed(H[0])
    log.stored(H[2])
    log.removed(H[2])  # stored and gone again within one burst: net, gone
    log.stored(H[0])   # removed and back: net, held
    assert wakes == [1]  # once per burst, not per event
    delta = log.read(reader, first.epoch, first.seq)
    assert not delta.snapshot and delta.seq == 6
    assert sorted(delta.stored) == [H[0]] and delta.removed == [H[2]]
    assert log.held() == {H[0], H[1]}


def test_other_epoch_or_lost_events_mean_a_snapshot():
    log = KVEventLog(max_events=3)
    reader = log.subscribe(lambda: None)
    for h in H[:5]:
        log.stored(h)
    assert log.read(reader, "another-engine-start", 5).snapshot
    behind = log.read(reader, log.epoch, 1)  # events 2.. are gone: only 3..5 kept
    assert behind.snapshot and sorted(behind.stored) == sorted(H[:5])
    assert not log.read(reader, log.epoch, 2).snapshot  # 3..5 are all it misses
    log.unsubscribe(reader)


def test_block_manager_reports_what_its_prefix_cache_holds():
    bm = BlockManager(num_blocks=4, block_size=4)
    log = bm.events = KVEventLog()
    prompt = list(range(10))
    req = Request("a", prompt, SamplingParams(max_tokens=1))
    assert bm.allocate_slots(req, len(prompt))
    req.num_computed_tokens = len(prompt)
    bm.cache_full_blocks(req)
    assert log.held() == set(hash_chain(prompt, 4))  # two full blocks, not the partial one
    bm.free(req)
    other = Request("b", [99] * 16, SamplingParams(max_tokens=1))
    assert bm.allocate_slots(other, 16)  # takes every block: the cached ones are reused
    assert log.held() == set()
