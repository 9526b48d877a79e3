"""Probes of a peer's KV endpoint: is the KV path to it usable right now?

A probe is what ``KVConnector.probe`` starts (the engine's ProbePeer RPC, asked by
the Coordinator's pair checks and ``pdserve doctor``). It runs on the engine thread,
driven by ``DispatchConnector.collect_events`` like a transfer, and never touches a
request's blocks or the handshake cache transfers use::

    start: PROBE (our layout, x = probe id) sent; an empty read submitted (connects)
      the empty read FAILED            -> failed: the endpoint cannot be reached
      PROBE_REJECT                     -> failed: the peer's reason (layout mismatch)
      PROBE_ACK, layouts differ        -> failed: the fields that differ
      PROBE_ACK, compatible, no test   -> ok
      PROBE_ACK, compatible, test      -> one block run read from the peer into the
                                          worker's scratch buffer -> ok / failed
      deadline                         -> failed: no answer within timeout_s

Every probe ends exactly once, by calling its ``done`` with a ``ProbeResult``;
``close`` ends the live ones as failed.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.kv_transfer.layout import KVLayout
from pdserve.engine.kv_transfer.transport.base import BatchHandle
from pdserve.engine.kv_transfer.worker import ConnectorWorker

_probe_ids = itertools.count(1)


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    reason: str = ""
    handshake_s: float = 0.0  # PROBE sent -> answer received
    transfer_s: float = 0.0  # test read submitted -> settled
    transfer_bytes: int = 0
    peer_compat_hash: str = ""


ProbeDone = Callable[[ProbeResult], None]


@dataclass
class _Probe:
    probe_id: str
    peer: str
    test_transfer: bool
    deadline: float
    done: ProbeDone
    started_s: float = field(default_factory=time.monotonic)
    reach: BatchHandle | None = None
    handshake_s: float = 0.0
    peer_layout: KVLayout | None = None
    read: BatchHandle | None = None
    read_started_s: float = 0.0


class PeerProbes:
    """The live probes of one connector. Engine thread only (``DispatchConnector``)."""

    def __init__(self, worker: ConnectorWorker) -> None:
        self._worker = worker
        self._live: dict[str, _Probe] = {}

    @property
    def num_live(self) -> int:
        return len(self._live)

    def start(self, peer: str, test_transfer: bool, timeout_s: float, done: ProbeDone) -> None:
        probe = _Probe(f"probe-{next(_probe_ids)}-{time.monotonic_ns()}", peer, test_transfer,
                       time.monotonic() + timeout_s, done)
        if test_transfer and self._worker.scratch is None:
            done(ProbeResult(False, "this engine's transport has no scratch buffer for a test transfer"))
            return
        self._live[probe.probe_id] = probe
        probe.reach = self._worker.reach(peer)
        self._worker.send(peer, "PROBE", x=probe.probe_id, layout=self._worker.layout.to_dict())

    def receive(self, msg: dict) -> None:
        """A PROBE_ACK or PROBE_REJECT; one for no live probe (late, or not ours) is dropped."""
        probe = self._live.get(msg["x"])
        if probe is None or msg["from"] != probe.peer or probe.peer_layout is not None:
            return
        probe.handshake_s = msg["rx_s"] - probe.started_s
        if msg["t"] == "PROBE_REJECT":
            self._end(probe, False, str(msg.get("reason", "rejected by peer")))
            return
        try:
            theirs = KVLayout.from_dict(msg["layout"])
        except (KeyError, TypeError, ValueError) as exc:
            self._end(probe, False, f"malformed probe answer from {probe.peer}: {exc}")
            return
        probe.peer_layout = theirs
        reason = self._worker.layout.mismatch(theirs)
        if reason is not None:
            self._end(probe, False, f"incompatible KV layout with {probe.peer}: {reason}")
        elif not probe.test_transfer:
            self._end(probe, True)
        else:
            probe.read_started_s = time.monotonic()
            probe.read = self._worker.read_probe(probe.peer, theirs)

    def advance(self, now: float) -> None:
        """Every step: settle reads, notice unreachable peers and deadlines."""
        for probe in list(self._live.values()):
            reach = probe.reach.status() if probe.reach is not None else None
            if probe.peer_layout is None and reach is not None and reach.is_failed:
                self._end(probe, False, f"cannot reach KV endpoint {probe.peer}: {reach.message}")
            elif probe.read is not None and not (status := probe.read.status()).is_pending:
                ok = status.is_done
                reason = "" if ok else f"test transfer from {probe.peer} failed: {status.message}"
                self._end(probe, ok, reason, transfer_s=now - probe.read_started_s)
            elif now >= probe.deadline:
                stage = "the test transfer" if probe.read is not None else "an answer to PROBE"
                self._end(probe, False, f"no reply from KV endpoint {probe.peer}: timed out "
                                        f"after {now - probe.started_s:.1f} s waiting for {stage}")

    def close(self) -> None:
        for probe in list(self._live.values()):
            self._end(probe, False, "the engine is shutting down")

    def _end(self, probe: _Probe, ok: bool, reason: str = "", transfer_s: float = 0.0) -> None:
        if self._live.pop(probe.probe_id, None) is None:
            return
        read_bytes = probe.read.num_bytes if probe.read is not None and ok else 0
        peer_hash = probe.peer_layout.compat_hash if probe.peer_layout is not None else ""
        probe.done(ProbeResult(ok, reason, probe.handshake_s, transfer_s, read_bytes, peer_hash))
