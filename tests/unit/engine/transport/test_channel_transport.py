"""The submit path every channel transport shares, with a transport that only records.

A batch is checked locally, queued on the peer's link, checked against the peer's
advertised regions, and only then handed to ``_move``. No byte moves here: the
addresses are numbers, never dereferenced. Every kv- thread is gone at the end.
"""

from __future__ import annotations

import pytest

from pdserve.engine.kv_transfer.transport import TransferItem
from pdserve.engine.kv_transfer.transport.channel_transport import ChannelTransport
from tests.unit.engine.transport.leaks import assert_kv_threads_gone

LOCAL, REMOTE, SIZE = 0x10000, 0x80000, 0x1000
UNREACHABLE = "127.0.0.1:1"


class Recording(ChannelTransport):
    name = "recording"

    def __init__(self, *, finishes_empty_batches: bool = False) -> None:
        self.finishes_empty_batches = finishes_empty_batches
        self.moved: list = []
        super().__init__(host="127.0.0.1", port=0, auth_token="t", timeout_s=2.0)

    def _welcome(self) -> dict:
        return {**super()._welcome(), "extra": "from the peer"}

    def _move(self, link, sock, handle, batch) -> None:
        self.moved.append((link.info["extra"], batch.local.tolist(), batch.remote.tolist(),
                           batch.lengths.tolist(), batch.is_write))
        handle.finish()


@pytest.fixture
def pair():
    p, d = Recording(), Recording()
    p.register_memory(LOCAL, SIZE)
    d.register_memory(REMOTE, SIZE)
    yield p, d
    p.close()
    d.close()
    assert_kv_threads_gone()


def test_checked_batch_reaches_move_coalesced_with_the_peer_welcome(pair):
    p, d = pair
    items = [TransferItem(LOCAL, REMOTE, 64), TransferItem(LOCAL + 64, REMOTE + 64, 64)]
    assert p.write_batch(d.endpoint, items).wait().is_done
    assert p.read_batch(d.endpoint, items[:1]).wait().is_done
    assert p.moved == [
        ("from the peer", [LOCAL], [REMOTE], [128], True),
        ("from the peer", [LOCAL], [REMOTE], [64], False),
    ]


def test_ranges_outside_either_side_fail_before_move(pair):
    p, d = pair
    local_bad = p.write_batch(d.endpoint, [TransferItem(LOCAL + SIZE, REMOTE, 64)])
    assert local_bad.status().is_failed and "local range" in local_bad.status().message
    remote_bad = p.write_batch(d.endpoint, [TransferItem(LOCAL, REMOTE + SIZE - 8, 64)])
    status = remote_bad.wait()
    assert status.is_failed and "outside the peer registered memory" in status.message
    assert p.moved == []


def test_empty_batch_skips_the_peer_only_where_the_transport_says_so(pair):
    p, _ = pair
    assert p.write_batch(UNREACHABLE, []).wait().is_failed  # it travelled and met no peer
    skipping = Recording(finishes_empty_batches=True)
    try:
        assert skipping.write_batch(UNREACHABLE, []).status().is_done
    finally:
        skipping.close()
    assert p.moved == skipping.moved == []
