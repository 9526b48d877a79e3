"""Every KV transport between two real processes: bytes, refusals, notify, auth, faults.

The test process plays P (prefill); ``kv_peer`` runs in a child process and plays D,
holding a KV tensor shaped like the engine's. Each (layer, K|V, block) piece moves
as one TransferItem. Peers are reaped and shared-memory files removed at the end.
"""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest
import torch

from pdserve.engine.kv_transfer.transport import TransferItem, create_transport
from tests.unit.engine.transport.kv_peer import (
    BLOCK_BYTES,
    KV_SHAPE,
    NUM_BLOCKS,
    Peer,
    allocate_kv,
    fill,
    piece_addr,
)
from tests.unit.engine.transport.leaks import assert_kv_threads_gone

NAMES = ["tcp", "shm", "mooncake", "nixl"]
TOKEN = "s3cret"
TIMEOUT_S = 2.0  # tight enough to test, loose enough for a loaded 2-core CI box
SLACK_S = 1.5


class Side:
    """P: the transport under test, living in this process, and its KV tensor."""

    def __init__(self, name: str, auth_token: str) -> None:
        self.transport = create_transport(name, auth_token=auth_token, timeout_s=TIMEOUT_S)
        self.kv, self.owner = allocate_kv(name)
        self.transport.register_memory(self.kv.data_ptr(), self.kv.nbytes)

    def piece(self, layer: int, kv: int, block: int) -> int:
        return piece_addr(self.kv.data_ptr(), layer, kv, block)

    def close(self) -> None:
        self.transport.close()
        if self.owner is not None:
            self.owner.close()


def finish(transport, handle, limit_s: float = TIMEOUT_S + SLACK_S):
    """Poll like the engine loop does, until the batch is terminal or ``limit_s`` passes."""
    deadline = time.monotonic() + limit_s
    while (status := transport.poll(handle)).is_pending and time.monotonic() < deadline:
        time.sleep(0.005)
    return status


def stop(pid: int, limit_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once the kernel shows it stopped: ``kill`` returns
    before every thread has stopped, and a same-host transport is fast enough to finish
    a batch (fence included) in that gap."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if all(_thread_state(path) == "T" for path in glob.glob(f"/proc/{pid}/task/*/stat")):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop")


def _thread_state(stat_path: str) -> str:
    with open(stat_path) as f:
        return f.read().rpartition(")")[2].split()[0]


@pytest.fixture(scope="module", params=NAMES)
def pair(request, tmp_path_factory):
    name = request.param
    peer = Peer(name, tmp_path_factory.mktemp(name), auth_token=TOKEN)
    side = Side(name, TOKEN)
    yield side, peer
    side.close()
    assert peer.reap() == 0
    assert not glob.glob(f"/dev/shm/pdserve-kv-{os.getpid()}-*"), "shm segment leaked"
    assert_kv_threads_gone()


def test_block_pieces_pushed_and_pulled_byte_exact(pair):
    side, peer = pair
    fill(side.kv, seed=1)
    moves = [(0, 7), (1, 2), (2, 5), (3, 0)]  # (P block, D block): D's blocks are scattered
    items = [
        TransferItem(side.piece(layer, kv, src), peer.piece(layer, kv, dst), BLOCK_BYTES)
        for layer in range(KV_SHAPE[0]) for kv in range(2) for src, dst in moves
    ]
    status = finish(side.transport, side.transport.write_batch(peer.endpoint, items))
    assert status.is_done, status.message
    remote = peer.dump()
    for src, dst in moves:
        assert torch.equal(remote[:, :, dst], side.kv[:, :, src])
    assert not remote[:, :, [1, 3, 4, 6]].any(), "a block nobody wrote changed"

    peer.ask("fill 2")
    expected = peer.dump()
    items = [
        TransferItem(side.piece(layer, kv, b), peer.piece(layer, kv, b), BLOCK_BYTES)
        for layer in range(KV_SHAPE[0]) for kv in range(2) for b in (6, 3)
    ]
    status = finish(side.transport, side.transport.read_batch(peer.endpoint, items))
    assert status.is_done, status.message
    assert torch.equal(side.kv[:, :, [6, 3]], expected[:, :, [6, 3]])


def test_write_outside_registered_memory_is_refused_and_peer_keeps_serving(pair):
    side, peer = pair
    t = side.transport
    past_end = TransferItem(side.piece(0, 0, 0), peer.addr + peer.nbytes - 64, BLOCK_BYTES)
    status = finish(t, t.write_batch(peer.endpoint, [past_end]))
    assert status.is_failed and "outside the peer registered memory" in status.message
    local_bad = TransferItem(side.kv.data_ptr() - BLOCK_BYTES, peer.addr, BLOCK_BYTES)
    status = finish(t, t.write_batch(peer.endpoint, [local_bad]))
    assert status.is_failed and "local range" in status.message

    # Even a P that skips its own check (here: believes D registered far more) cannot
    # write outside D's memory: the peer side refuses as well.
    t._channel.link(peer.endpoint).info["regions"] = [[peer.addr, 1 << 40]]
    far = TransferItem(side.piece(0, 0, 0), peer.addr + (1 << 30), BLOCK_BYTES)
    status = finish(t, t.write_batch(peer.endpoint, [far]))
    assert status.is_failed, "an out-of-range write was accepted"

    ok = TransferItem(side.piece(0, 0, 1), peer.piece(1, 1, 7), BLOCK_BYTES)
    status = finish(t, t.write_batch(peer.endpoint, [ok]))
    assert status.is_done, status.message
    assert peer.proc.poll() is None


def test_notify_round_trip(pair):
    side, peer = pair
    side.transport.notify(peer.endpoint, b"DONE req-1 first_token=42")
    deadline = time.monotonic() + 5
    while not (notes := peer.ask("notes")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert notes == [[side.transport.endpoint, "DONE req-1 first_token=42"]]

    peer.ask(f"notify {side.transport.endpoint} FREE req-1")
    got: list = []
    while not got and time.monotonic() < deadline:
        got = side.transport.recv_notifications()
        time.sleep(0.02)
    assert [(endpoint, body) for endpoint, body, _ in got] == [(peer.endpoint, b"FREE req-1")]
    assert got[0][2] <= time.monotonic()  # stamped when it came off the wire


def test_wrong_auth_token_is_refused_with_a_logged_reason(pair):
    side, peer = pair
    intruder = Side(pair[0].transport.name, auth_token="guess")
    try:
        item = TransferItem(intruder.piece(0, 0, 0), peer.piece(0, 0, 0), BLOCK_BYTES)
        status = finish(intruder.transport, intruder.transport.write_batch(peer.endpoint, [item]))
    finally:
        intruder.close()
    assert status.is_failed and "bad auth token" in status.message
    assert "bad auth token" in peer.log_path.read_text()


def test_stopped_then_dead_peer_fail_within_timeout(pair, tmp_path):
    side, _ = pair
    t = side.transport
    victim = Peer(t.name, tmp_path, auth_token=TOKEN)
    items = [
        TransferItem(side.piece(layer, kv, b), victim.piece(layer, kv, b), BLOCK_BYTES)
        for layer in range(KV_SHAPE[0]) for kv in range(2) for b in range(NUM_BLOCKS)
    ]
    status = finish(t, t.write_batch(victim.endpoint, items))
    assert status.is_done, status.message

    stop(victim.proc.pid)
    started = time.monotonic()
    status = finish(t, t.write_batch(victim.endpoint, items))
    assert status.is_failed and time.monotonic() - started <= TIMEOUT_S + SLACK_S, status

    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(timeout=10)
    started = time.monotonic()
    status = finish(t, t.write_batch(victim.endpoint, items))
    assert status.is_failed and time.monotonic() - started <= TIMEOUT_S + SLACK_S, status
    assert victim.reap() == -signal.SIGKILL


def test_a_batch_of_thousands_of_scattered_pieces_lands_byte_exact(pair):
    """A re-laid out transfer (P's heads into D's tokens) is one item per token and run
    of heads: thousands in one batch, none adjacent on both sides. Every transport
    moves them all (Mooncake without overflowing its queues)."""
    side, peer = pair
    fill(side.kv, seed=3)
    piece = 32
    count = side.kv.nbytes // piece  # 4,096
    order = torch.randperm(count, generator=torch.Generator().manual_seed(0)).tolist()
    base, remote_base = side.kv.data_ptr(), peer.piece(0, 0, 0)
    items = [TransferItem(base + i * piece, remote_base + j * piece, piece) for i, j in enumerate(order)]
    started = time.monotonic()
    status = finish(side.transport, side.transport.write_batch(peer.endpoint, items))
    assert status.is_done, f"{status.message} after {time.monotonic() - started:.1f} s"
    landed = peer.dump().view(torch.uint8).view(count, piece)
    assert torch.equal(landed[order], side.kv.view(torch.uint8).view(count, piece))


@pytest.mark.parametrize("scattered", ["there", "on both sides"])
def test_pieces_scattered_over_the_peers_memory_move_both_ways(pair, scattered):
    """A KV over D's scattered blocks: 1,024 small pieces in every other place of the
    peer's memory, from one run of ours or from every other place of ours too. Pushed,
    then pulled back (Mooncake lands them in a buffer the peer lends, which the peer
    scatters, or gathers first for the read)."""
    side, peer = pair
    fill(side.kv, seed=6)
    piece = 64
    count = side.kv.nbytes // piece // 2  # 1,024: half of each side's pieces
    gen = torch.Generator().manual_seed(2)
    there = (torch.randperm(count, generator=gen) * 2).tolist()
    here = list(range(count)) if scattered == "there" else (torch.randperm(count, generator=gen) * 2).tolist()
    base, remote_base = side.kv.data_ptr(), peer.piece(0, 0, 0)
    items = [TransferItem(base + i * piece, remote_base + j * piece, piece) for i, j in zip(here, there, strict=True)]
    status = finish(side.transport, side.transport.write_batch(peer.endpoint, items))
    assert status.is_done, status.message
    ours = side.kv.view(torch.uint8).view(-1, piece)
    landed = peer.dump().view(torch.uint8).view(-1, piece)
    assert torch.equal(landed[there], ours[here])
    if side.transport.name == "mooncake":
        assert "landing" in side.transport._channel.link(peer.endpoint).info

    peer.ask("fill 7")
    expected = peer.dump().view(torch.uint8).view(-1, piece)
    status = finish(side.transport, side.transport.read_batch(peer.endpoint, items))
    assert status.is_done, status.message
    assert torch.equal(ours[here], expected[there])


def test_pieces_scattered_here_that_are_one_run_there_move_in_order(pair):
    """The other half of a re-laid out transfer: small pieces from all over P's memory
    landing side by side in D's, and read back the same way (Mooncake stages them, one
    segment per run; the others move them as they are)."""
    side, peer = pair
    fill(side.kv, seed=4)
    piece = 256
    count = side.kv.nbytes // piece  # 512
    order = torch.randperm(count, generator=torch.Generator().manual_seed(1)).tolist()
    base, remote_base = side.kv.data_ptr(), peer.piece(0, 0, 0)
    items = [TransferItem(base + i * piece, remote_base + j * piece, piece)
             for j, i in enumerate(order)]  # D's j-th piece is P's order[j]-th
    status = finish(side.transport, side.transport.write_batch(peer.endpoint, items))
    assert status.is_done, status.message
    landed = peer.dump().view(torch.uint8).view(count, piece)
    assert torch.equal(landed, side.kv.view(torch.uint8).view(count, piece)[order])
    if side.transport.name == "mooncake":  # it went through the staging buffer
        assert list(side.transport._staging) == [peer.endpoint]

    # Pulled back the other way round (D reading P's slabs): the peer's side is one run
    # once sorted, ours is scattered.
    peer.ask("fill 5")
    expected = peer.dump().view(torch.uint8).view(count, piece)
    items.reverse()
    status = finish(side.transport, side.transport.read_batch(peer.endpoint, items))
    assert status.is_done, status.message
    assert torch.equal(side.kv.view(torch.uint8).view(count, piece)[order], expected)
