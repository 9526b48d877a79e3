"""Peer checks: this agent's prefill engines probe the decode peers the Controller lists.

The Controller sends the peer list (``PeerList``: every decode engine with a KV
endpoint, each listed at a version) in a heartbeat's reply whenever the agent holds
another version. For each of its prefill engines the agent asks the engine
(``Prober.probe_peer``: the embedded engine's ProbePeer, vLLM's side channel) to
probe each listed peer with the engine's ``kv_compat_hash``, and reports in the
engine's heartbeat ``peers_checked_version`` (every peer of that list version has a
result) and ``unreachable_peers`` (the listed peers whose last probe failed). The
Controller publishes both in its view (``controller/cluster.py``), and Coordinators
route on them without probing: one probe per pair per interval for the cluster, run
by the P engines' own agents (O(D) each), instead of one per Coordinator per pair.

When, how often and how many at once are ``runtime.pair_probes.PairProbes``'s (a
usable pair every ``interval_s``, stretched past ``max_reprobes_per_s``; a failed one
every ``retry_s``). A new list is probed at once (only its new peers: the others keep
their results) and the heartbeat goes out when it is done (``on_checked``), so a new
decode engine's pairs are known within a probe and a heartbeat.

Invariants: ``checked_version`` names a list all of whose compatible peers have a
result for their listed KV endpoint; an engine relaunched (a new address) or no
longer prefill starts again from 0 with no results; a peer that left the list is
forgotten (if it comes back it is listed at a new version).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pdserve.api.proto import controller_pb2 as pb
from pdserve.runtime.aio import wait_event
from pdserve.runtime.pair_probes import PairProbes

from .launch import ProbeFailed, Prober

log = logging.getLogger(__name__)


class PeerChecks:
    def __init__(self, prober_of: Callable[[object], Prober | None], on_checked: Callable[[], None],
                 interval_s: float = 30.0, retry_s: float = 2.0, timeout_s: float = 3.0,
                 max_concurrency: int = 8, max_reprobes_per_s: float = 10.0) -> None:
        """``prober_of(engine)``: a prober of a supervised engine that serves now, else
        None; ``on_checked()``: a list version was checked (the agent heartbeats at once)."""
        self.peers = pb.PeerList()
        self.probes = PairProbes(interval_s, retry_s, timeout_s, max_concurrency, max_reprobes_per_s)
        self._prober_of, self._on_checked = prober_of, on_checked
        self._checked: dict[str, tuple[str, int]] = {}  # instance id -> (engine address, version)
        self._new_list = asyncio.Event()

    # -- called by the agent's heartbeat ---------------------------------------

    def update(self, peers: pb.PeerList) -> None:
        """A heartbeat's reply carried a new list: probe its new peers at once."""
        self.peers = peers
        self._new_list.set()

    def fill(self, report: pb.InstanceReport) -> None:
        """Add this engine's peer verdicts to its heartbeat report."""
        report.checks_peers = True
        address, version = self._checked.get(report.instance_id, ("", 0))
        if report.role != "prefill" or address != report.engine_address:
            return
        report.peers_checked_version = version
        for peer in self.peers.decode:
            result = self.probes.result((report.instance_id, peer.instance_id), peer.kv_endpoint)
            if result is not None and not result.ok:
                report.unreachable_peers.add(instance_id=peer.instance_id, kv_endpoint=peer.kv_endpoint,
                                             reason=result.reason)

    # -- the loop ----------------------------------------------------------------

    async def run(self, engines: Callable[[], list]) -> None:
        """Started by the agent: a round on every new list, else every ``retry_s``."""
        while True:
            self._new_list.clear()
            try:
                await self.check_once(engines())
            except Exception:  # noqa: BLE001 - a bug in one round must not end the checks
                log.exception("peer checks failed")
            await wait_event(self._new_list, min(self.probes.retry_s, self.probes.interval_s))

    async def check_once(self, engines: list) -> None:
        """Probe each due (prefill engine, listed peer) pair, engine by engine (the
        probes queue in that order): each engine notes the list it has checked, and
        tells the agent, as soon as its own peers are done, so on a new cluster the
        first pairs are routable after one engine's probes, not everyone's."""
        peers, now = self.peers, time.monotonic()
        checking = []
        for inst in engines:
            prober = self._prober_of(inst) if inst.role == "prefill" else None
            own_hash = inst.health.kv_compat_hash if inst.health is not None else ""
            if prober is None:
                self._checked.pop(inst.instance_id, None)
                continue
            if self._checked.get(inst.instance_id, ("", 0))[0] != inst.address:  # relaunched
                self._checked[inst.instance_id] = (inst.address, 0)
                self.probes.forget([k for k in self.probes.results if k[0] == inst.instance_id])
            listed = [d for d in peers.decode if d.kv_compat_hash == own_hash and d.instance_id != inst.instance_id]
            checking.append((inst, prober, listed))
        await asyncio.gather(*(self._check_engine(inst, prober, listed, peers.version, now)
                               for inst, prober, listed in checking))
        wanted = {(inst.instance_id, d.instance_id) for inst, _, listed in checking for d in listed}
        version_before = self.probes.version
        self.probes.forget([k for k in self.probes.results if k not in wanted])
        if self.probes.version != version_before:
            self._on_checked()

    async def _check_engine(self, inst, prober: Prober, listed: list, list_version: int, now: float) -> None:
        """One prefill engine's due probes; then whether it has checked ``list_version``."""
        version_before = self.probes.version
        await asyncio.gather(*(self._probe(inst, prober, d) for d in listed
                               if self.probes.is_due((inst.instance_id, d.instance_id), d.kv_endpoint, now)))
        address, checked = self._checked[inst.instance_id]
        is_moved = checked != list_version and all(
            self.probes.result((inst.instance_id, d.instance_id), d.kv_endpoint) for d in listed)
        if is_moved:
            self._checked[inst.instance_id] = (address, list_version)
        if is_moved or self.probes.version != version_before:  # a verdict changed: report it now
            self._on_checked()

    async def _probe(self, inst, prober: Prober, peer: pb.Peer) -> None:
        async def ask() -> tuple[bool, str, float]:
            try:
                answer = await prober.probe_peer(peer.kv_endpoint, self.probes.timeout_s)
            except ProbeFailed as exc:
                return False, f"prefill engine {inst.instance_id} did not answer the probe: {exc}", 0.0
            return answer.ok, answer.reason, answer.handshake_s

        await self.probes.probe((inst.instance_id, peer.instance_id), peer.kv_endpoint, ask)
