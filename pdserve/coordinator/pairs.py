"""Pair checks: which (prefill, decode) pairs have a KV path that answered a probe.

An engine is routable as a pair member only with a peer whose KV endpoint it has
reached. Who probes depends on the view's source:

- **Under a Controller that publishes pair checks** (``InstanceRegistry.published_pairs``,
  every view of this version's Controller): the NodeAgent of each prefill engine
  probes the decode peers the Controller lists to it, and the Controller publishes
  which pairs were checked and the few that failed (``instances.PublishedPairs``).
  A pair is probed once per cluster, not once per Coordinator, and the Coordinator
  sends no probe of its own, except after a failed leg: ``recheck`` re-probes that
  engine's pairs here at once (the agent would see a broken path only at its next
  probe, up to ``interval_s`` later), and a pair whose re-probe fails stays out of
  this Coordinator's routing until a re-probe passes, whatever the view says.
- **Otherwise** (a static engine list, or a view that carries no pair checks): for
  each routable P and each routable D with the same ``kv_compat_hash`` this
  Coordinator asks P (the engine's ProbePeer RPC, a layout handshake over its KV
  transport, no test transfer) to probe D's KV endpoint; a pair of different compat
  hashes is never probed (its reason says so).

The verdicts, their states and thresholds are ``runtime.pair_probes.PairProbes``'s
(usable pairs re-probed every ``interval_s``, failed ones every ``retry_s``, a
rechecked one at once, keeping its last result until the new one; at most
``max_concurrency`` probes at once, each within ``timeout_s``). The router pairs
only over pairs ``usable`` answers yes for. Every change of which pairs are usable
wakes the requests waiting for a route (``InstanceRegistry.notify_changed``).

One task (``run``), on the app's event loop, owns the results; the router and
/ready read them on the same loop. ``version`` counts the changes of what ``usable``
answers that the registry's ``members_version`` does not (the published checks
change it), so the router may keep its pairing until either moves.

Cost: probing itself, a round looks at every P × D pair only when one may be due:
the view changed what pairs read (``InstanceRegistry.members_version``: instances,
roles, KV endpoints, compat hashes, health), a leg failed (``recheck``), or the
earliest probe's age runs out; else (the usual view: new load figures) it returns at
once. Under published checks a round looks only at the rechecked pairs.
"""

from __future__ import annotations

import asyncio
import time

from pdserve.runtime.pair_probes import PairProbes, PairResult

from .engine_errors import EngineCallError, Unsupported
from .instances import EngineEndpoint, InstanceRegistry
from .rounds import Rounds

__all__ = ["PairChecks", "PairResult"]


class PairChecks(Rounds):
    """Started by the app after the view source: one round first (``Rounds``), so
    routing starts with checked pairs; then a round on every view change or retry_s."""

    task_name = "pair-checks"

    def __init__(self, registry: InstanceRegistry, interval_s: float = 30.0,
                 retry_s: float = 2.0, timeout_s: float = 3.0, max_concurrency: int = 8) -> None:
        self.registry = registry
        self.probes = PairProbes(interval_s, retry_s, timeout_s, max_concurrency)
        self._members_seen = -1  # the registry's ``members_version`` the last scan saw
        self._next_due_s = 0.0  # monotonic: the earliest probe's age runs out

    @property
    def is_published(self) -> bool:
        """The view carries the Controller's pair checks: probe only what ``recheck`` asks."""
        return self.registry.published_pairs is not None

    @property
    def version(self) -> int:
        return self.probes.version

    @property
    def num_probes(self) -> int:
        return self.probes.num_probes

    # -- read by the router and /ready ---------------------------------------------

    def usable(self, p: EngineEndpoint, d: EngineEndpoint) -> bool:
        key = (p.instance_id, d.instance_id)
        published = self.registry.published_pairs
        if published is None:
            return self.probes.is_usable(key, d.kv_endpoint)
        local = self.probes.result(key, d.kv_endpoint)  # a recheck after a failed leg
        return (local is None or local.ok) and published.usable(p, d)

    def describe(self) -> list[dict]:
        """Every P × D of the view with whether it is usable and why not (/ready?verbose=1)."""
        rows = []
        published = self.registry.published_pairs
        for p, d in self._pairs(self.registry.all(), routable_only=False):
            row = {"prefill": p.instance_id, "decode": d.instance_id, "kv_endpoint": d.kv_endpoint}
            reason = self._not_probed_reason(p, d)
            result = self.probes.result((p.instance_id, d.instance_id), d.kv_endpoint)
            if result is not None:
                row["checked_s_ago"] = round(time.monotonic() - result.checked_s, 1)
                row["handshake_s"] = round(result.handshake_s, 4)
            if reason is None and result is not None and not result.ok:
                reason = result.reason
            elif reason is None and published is not None:
                reason = published.reason(p, d)
                row["checked_by"] = "controller"
            elif reason is None:
                reason = "" if result is not None else "not probed yet"
            row["usable"] = reason == ""
            row["reason"] = reason
            rows.append(row)
        return rows

    # -- written by the lifecycle --------------------------------------------------

    def recheck(self, instance_id: str) -> None:
        """A leg on this engine failed: re-probe its pairs at the next round. Under
        published checks its usable pairs are taken on here (``_take_on``), as no probe
        of this Coordinator's knows them yet."""
        inst = self.registry.get(instance_id)
        if self.is_published and inst is not None and inst.routable:
            self._take_on(inst)
        if self.probes.mark_due(instance_id):
            self._next_due_s = 0.0

    def _take_on(self, inst: EngineEndpoint) -> None:
        """Each usable pair of ``inst`` probed at the next round, keeping the view's
        verdict till then: O(engines of the other role)."""
        other = {"prefill": "decode", "decode": "prefill"}.get(inst.role)
        for peer in self.registry.all():
            if peer.role != other or not peer.routable:
                continue
            p, d = (inst, peer) if inst.role == "prefill" else (peer, inst)
            key = (p.instance_id, d.instance_id)
            if self.usable(p, d) and self.probes.result(key, d.kv_endpoint) is None:
                self.probes.results[key] = PairResult(True, "", d.kv_endpoint, 0.0, due=True)

    # -- the task ------------------------------------------------------------------

    async def wait(self) -> None:
        await self.registry.wait_changed(min(self.probes.retry_s, self.probes.interval_s))

    async def round(self) -> None:
        await self.check_once()

    async def check_once(self) -> None:
        """Probe every pair that is due; wake route waiters if usability changed."""
        now = time.monotonic()
        members = self.registry.members_version
        if members == self._members_seen and now < self._next_due_s:
            return  # nothing due (``Cost`` above)
        if self.is_published:
            candidates, gone = self._taken_on()
        else:
            candidates, gone = self._pairs(self.registry.all(), routable_only=True), []
        due = [(p, d) for p, d in candidates
               if self._not_probed_reason(p, d) is None
               and self.probes.is_due((p.instance_id, d.instance_id), d.kv_endpoint, now)]
        if not due and not gone:
            self._members_seen, self._next_due_s = members, self.probes.next_due_s()
            return
        before = self.probes.usable_keys()
        await asyncio.gather(*(self._probe(p, d) for p, d in due))
        if self.is_published:  # one that passed its re-probe goes back to the view's verdict
            gone += [key for key, r in self.probes.results.items() if r.ok and not r.due]
        else:  # engines gone from the view
            live = {(p.instance_id, d.instance_id) for p, d in self._pairs(self.registry.all(), False)}
            gone = [key for key in self.probes.results if key not in live]
        self.probes.forget(gone)
        if self.probes.usable_keys() != before:
            self.registry.notify_changed()
        self._members_seen = members
        self._next_due_s = self.probes.next_due_s()

    def _taken_on(self) -> tuple[list[tuple[EngineEndpoint, EngineEndpoint]], list]:
        """Under published checks: the rechecked pairs still routable, and the keys of
        those that are not (an engine left the view or stopped being routable)."""
        pairs, gone = [], []
        for key in self.probes.results:
            p, d = self.registry.get(key[0]), self.registry.get(key[1])
            if (p is None or d is None or p.role != "prefill" or d.role != "decode"
                    or self._not_probed_reason(p, d) is not None):
                gone.append(key)
            else:
                pairs.append((p, d))
        return pairs, gone

    async def _probe(self, p: EngineEndpoint, d: EngineEndpoint) -> None:
        await self.probes.probe((p.instance_id, d.instance_id), d.kv_endpoint, lambda: self._ask(p, d))

    async def _ask(self, p: EngineEndpoint, d: EngineEndpoint) -> tuple[bool, str, float]:
        engine = self.registry.engine(p.address)
        try:
            answer = await engine.probe_peer(d.kv_endpoint, test_transfer=False,
                                             timeout_s=self.probes.timeout_s)
        except Unsupported:
            return False, f"prefill engine {p.instance_id} has no ProbePeer RPC (older pdserve)", 0.0
        except EngineCallError as exc:
            return False, f"prefill engine {p.instance_id} did not answer the probe: {exc}", 0.0
        return answer.ok, answer.reason, answer.handshake_s

    @staticmethod
    def _pairs(instances: list[EngineEndpoint], routable_only: bool):
        prefill = [i for i in instances if i.role == "prefill" and (i.routable or not routable_only)]
        decode = [i for i in instances if i.role == "decode" and (i.routable or not routable_only)]
        return [(p, d) for p in prefill for d in decode]

    @staticmethod
    def _not_probed_reason(p: EngineEndpoint, d: EngineEndpoint) -> str | None:
        """Why this pair is not probed at all, or None."""
        for inst in (p, d):
            if not inst.healthy:
                return f"{inst.instance_id} is not healthy"
            if inst.draining:
                return f"{inst.instance_id} is draining"
        if not d.kv_endpoint:
            return f"{d.instance_id} reports no KV endpoint"
        if p.kv_compat_hash != d.kv_compat_hash:
            return (f"KV compatibility hashes differ ({p.kv_compat_hash or 'none'} vs "
                    f"{d.kv_compat_hash or 'none'}): model, dtype or block size differ")
        return None
