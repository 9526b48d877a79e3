"""Pair checks: which (prefill, decode) pairs have a KV path that answered a probe.

An engine is routable as a pair member only with a peer whose KV endpoint it has
reached: for each routable P and each routable D with the same ``kv_compat_hash``,
the Coordinator asks P (the engine's ProbePeer RPC, a layout handshake over its KV
transport, no test transfer) to probe D's KV endpoint. The router pairs only over
pairs whose last probe passed (``usable``); a pair of different compat hashes is
never probed (its reason says so).

    unknown ──probe ok──▶ usable ──probe failed / a leg on it failed──▶ re-probed
       │                     ▲                                            │
       └──probe failed──▶ unusable ◀──────────────────────────────────────┘

Thresholds: a usable pair is re-probed every ``interval_s``; an unusable one every
``retry_s``; a pair one of whose engines just failed a leg (``recheck``) at once,
keeping its last result until the new one. A pair whose P or D changed KV endpoint
is unknown again. At most ``max_concurrency`` probes run at once; each ends within
``timeout_s``. Every change of which pairs are usable wakes the requests waiting
for a route (``InstanceRegistry.notify_changed``).

One task (``run``), on the app's event loop, owns the results; the router and
/ready read them on the same loop. ``version`` counts the changes of what ``usable``
answers (a pair's verdict, the KV endpoint it was probed at, a pair dropped), so the
router may keep its pairing until it moves.

Cost: a round looks at every P × D pair only when one may be due: the view changed
what pairs read (``InstanceRegistry.members_version``: instances, roles, KV endpoints,
compat hashes, health), a leg failed (``recheck``), or the earliest probe's age runs
out; else (the usual view: new load figures) it returns at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from .engine_errors import EngineCallError, Unsupported
from .instances import EngineEndpoint, InstanceRegistry
from .rounds import Rounds

log = logging.getLogger(__name__)


@dataclass(slots=True)  # one per P x D pair: 187,500 at 250 x 750 engines
class PairResult:
    ok: bool
    reason: str
    kv_endpoint: str  # D's KV endpoint the probe reached (a new one makes the pair unknown)
    checked_s: float  # monotonic time of the probe
    handshake_s: float = 0.0
    due: bool = False  # re-probe at the next round, whatever its age


class PairChecks(Rounds):
    """Started by the app after the view source: one round first (``Rounds``), so
    routing starts with checked pairs; then a round on every view change or retry_s."""

    task_name = "pair-checks"

    def __init__(self, registry: InstanceRegistry, interval_s: float = 30.0,
                 retry_s: float = 2.0, timeout_s: float = 3.0, max_concurrency: int = 8) -> None:
        self.registry = registry
        self.interval_s, self.retry_s, self.timeout_s = interval_s, retry_s, timeout_s
        self._limit = asyncio.Semaphore(max_concurrency)
        self._results: dict[tuple[str, str], PairResult] = {}  # (P id, D id) -> last probe
        self.version = 0  # bumped whenever ``usable`` may answer differently
        self._members_seen = -1  # the registry's ``members_version`` the last scan saw
        self._next_due_s = 0.0  # monotonic: the earliest probe's age runs out

    # -- read by the router and /ready ---------------------------------------------

    def usable(self, p: EngineEndpoint, d: EngineEndpoint) -> bool:
        result = self._results.get((p.instance_id, d.instance_id))
        return result is not None and result.ok and result.kv_endpoint == d.kv_endpoint

    def describe(self) -> list[dict]:
        """Every P × D of the view with whether it is usable and why not (/ready?verbose=1)."""
        rows = []
        for p, d in self._pairs(self.registry.all(), routable_only=False):
            row = {"prefill": p.instance_id, "decode": d.instance_id, "kv_endpoint": d.kv_endpoint}
            reason = self._not_probed_reason(p, d)
            result = self._results.get((p.instance_id, d.instance_id))
            if reason is None and result is not None and result.kv_endpoint == d.kv_endpoint:
                reason = "" if result.ok else result.reason
                row["checked_s_ago"] = round(time.monotonic() - result.checked_s, 1)
                row["handshake_s"] = round(result.handshake_s, 4)
            elif reason is None:
                reason = "not probed yet"
            row["usable"] = reason == ""
            row["reason"] = reason
            rows.append(row)
        return rows

    # -- written by the lifecycle --------------------------------------------------

    def recheck(self, instance_id: str) -> None:
        """A leg on this engine failed: re-probe its pairs at the next round."""
        for (p_id, d_id), result in self._results.items():
            if instance_id in (p_id, d_id):
                result.due = True
                self._next_due_s = 0.0

    # -- the task ------------------------------------------------------------------

    async def wait(self) -> None:
        await self.registry.wait_changed(min(self.retry_s, self.interval_s))

    async def round(self) -> None:
        await self.check_once()

    async def check_once(self) -> None:
        """Probe every pair that is due; wake route waiters if usability changed."""
        now = time.monotonic()
        members = self.registry.members_version
        if members == self._members_seen and now < self._next_due_s:
            return  # nothing due (``Cost`` above)
        due = [(p, d) for p, d in self._pairs(self.registry.all(), routable_only=True)
               if self._not_probed_reason(p, d) is None and self._is_due(p, d, now)]
        if not due:
            self._scanned(members)
            return
        before = {key for key, r in self._results.items() if r.ok}
        await asyncio.gather(*(self._probe(p, d) for p, d in due))
        live = {(p.instance_id, d.instance_id) for p, d in self._pairs(self.registry.all(), False)}
        for key in set(self._results) - live:  # engines gone from the view
            del self._results[key]
            self.version += 1
        if {key for key, r in self._results.items() if r.ok} != before:
            self.registry.notify_changed()
        self._scanned(members)

    def _scanned(self, members: int) -> None:
        """After a round that looked at every pair: when the next one must look again."""
        self._members_seen = members
        self._next_due_s = min((0.0 if r.due else r.checked_s + (self.interval_s if r.ok else self.retry_s)
                                for r in self._results.values()), default=float("inf"))

    def _is_due(self, p: EngineEndpoint, d: EngineEndpoint, now: float) -> bool:
        result = self._results.get((p.instance_id, d.instance_id))
        if result is None or result.due or result.kv_endpoint != d.kv_endpoint:
            return True
        return now - result.checked_s >= (self.interval_s if result.ok else self.retry_s)

    async def _probe(self, p: EngineEndpoint, d: EngineEndpoint) -> None:
        async with self._limit:
            ok, reason, handshake_s = await self._ask(p, d)
        old = self._results.get((p.instance_id, d.instance_id))
        if not ok and (old is None or old.ok or old.reason != reason):
            log.warning("pair %s -> %s unusable: %s", p.instance_id, d.instance_id, reason)
        elif ok and old is not None and not old.ok:
            log.info("pair %s -> %s usable again", p.instance_id, d.instance_id)
        self._results[(p.instance_id, d.instance_id)] = PairResult(
            ok, reason, d.kv_endpoint, time.monotonic(), handshake_s)
        if old is None or old.ok != ok or old.kv_endpoint != d.kv_endpoint:
            self.version += 1

    async def _ask(self, p: EngineEndpoint, d: EngineEndpoint) -> tuple[bool, str, float]:
        engine = self.registry.engine(p.address)
        try:
            answer = await engine.probe_peer(d.kv_endpoint, test_transfer=False,
                                             timeout_s=self.timeout_s)
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
