"""The transport helpers every transport relies on: coalescing, range checks, latching."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdserve.engine.kv_transfer.transport import TransferItem, create_transport
from pdserve.engine.kv_transfer.transport.base import BatchHandle, Regions, coalesce


def test_coalesce_merges_only_runs_contiguous_on_both_sides():
    items = [
        TransferItem(1000, 5000, 100),
        TransferItem(1100, 5100, 100),  # contiguous on both sides: merged
        TransferItem(1200, 9000, 100),  # remote jumps: new run
        TransferItem(1300, 9100, 0),  # empty: dropped
        TransferItem(1300, 9100, 50),
    ]
    assert coalesce(items).tolist() == [[1000, 5000, 200], [1200, 9000, 150]]
    assert coalesce(np.array(items, dtype=np.int64)).tolist() == coalesce(items).tolist()


def test_regions_name_the_first_range_outside():
    regions = Regions()
    regions.add(0x1000, 0x1000)
    addrs, lengths = np.array([0x1000, 0x1F00]), np.array([0x100, 0x200])
    message = regions.check(addrs, lengths, side="remote")
    assert message == "remote range [0x1f00, +512) is outside the peer registered memory"
    assert regions.check(addrs[:1], lengths[:1]) is None
    assert regions.check(np.array([0x1000]), np.array([-1])) is not None
    with pytest.raises(ValueError):
        regions.add(0, 10)


def test_batch_states_latch_and_deadline_fails_a_silent_batch():
    done = BatchHandle("peer", 10, timeout_s=5)
    assert done.finish() and not done.fail("late") and done.status().is_done
    silent = BatchHandle("peer", 10, timeout_s=0.05)
    assert silent.status().is_pending
    time.sleep(0.06)
    status = silent.status()
    assert status.is_failed and "timed out" in status.message
    assert not silent.finish() and silent.status().is_failed


def test_unknown_transport_name_is_rejected():
    with pytest.raises(ValueError, match="unknown KV transport"):
        create_transport("carrier-pigeon")
