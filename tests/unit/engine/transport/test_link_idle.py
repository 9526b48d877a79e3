"""A KV peer link at rest costs nothing: an engine holds one per peer it ever reached
(the Coordinators' pair probes reach every partner), so a sender that woke to sweep
every 0.2 s made an idle engine's CPU grow with the cluster (docs/benchmarks.md, "The
control plane against the number of engines"). It sweeps only when there is
something to sweep, and a socket retired while it waited is still closed soon."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

from pdserve.engine.kv_transfer.transport.link import PeerLink

CHANNEL = SimpleNamespace(limits=SimpleNamespace(idle_timeout_s=600.0))


class CountingLink(PeerLink):
    def __init__(self, *args) -> None:
        self.num_sweeps = 0
        super().__init__(*args)

    def _sweep(self) -> None:
        self.num_sweeps += 1
        super()._sweep()


def test_an_idle_link_never_wakes_and_a_retired_socket_is_still_closed():
    link = CountingLink(CHANNEL, "127.0.0.1:1")
    try:
        time.sleep(0.7)  # the old sender swept three times by now
        assert link.num_sweeps == 0
        ours, theirs = socket.socketpair()
        link.sock, link._reader_done = ours, threading.Event()
        link._reader_done.set()  # its reader has ended: the sender closes it
        link.reset(ours, "peer closed the connection")
        deadline = time.monotonic() + 5
        while ours.fileno() != -1:
            assert time.monotonic() < deadline, "the retired socket was never closed"
            time.sleep(0.01)
        theirs.close()
        sweeps = link.num_sweeps
        time.sleep(0.7)
        assert link.num_sweeps == sweeps  # at rest again
    finally:
        link.close()
