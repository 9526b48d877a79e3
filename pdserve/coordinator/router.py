"""The router: turns a request's prompt into a plan (which engines, which path).

Plans: ``pd`` (a prefill engine and a decode engine with equal ``kv_compat_hash``
whose pair passed its probe (``pairs.PairChecks``, when the app runs them: probed
by this Coordinator, or by the agents once per cluster and published by the Controller), chosen
by the per-pool policies; decode first for push and layerwise, whose D must
reserve blocks before P writes, prefill first for pull) or ``single`` (one engine
runs the whole request: conditional disaggregation on the chosen D, decided by
``conditional.decide``, or the hybrid fallback).

Fallback, when no PD pair exists (a pool is empty, no compatible pair, or no pair
whose probe passed: reason ``no_probed_pair``):
``hybrid`` runs whole requests on hybrid engines (with a Controller, it switches
engines to hybrid and says so with view mode FALLBACK); while none exists the
request waits as with ``queue`` if the view may still change into a route (a
Controller drives it, or an engine of the view is down or draining and may come
back), else it answers 503 at once (e.g. a static view of decode engines only:
nothing will pair them or make one hybrid); ``queue`` waits for the view to change
until the deadline; ``fail`` answers 503 at once. A colocated deployment (only hybrid engines
by design: view mode COLOCATED) is no fallback: its engines serve under every
policy and nothing is counted as a fallback. Never silent: each fallback is counted
(``pdserve_coordinator_fallbacks_total``) and the reason is in the error text.

A retry whose pools hold only engines that already failed the request waits (with a
Controller, up to ``suspect_s``) for the view to change before it tries them again: the
Controller takes a dead engine out of the view within a heartbeat and, with the
``hybrid`` policy, switches the other pool's engines to serve whole requests.

Cost: which engines can pair (``compatible``: every P × D) is worked out once per
set of pools and kept while the registry's ``members_version``, the pair checks'
``version`` and the pools' members stay the same (the only inputs of ``can_pair``:
compat hashes and KV endpoints change only through a view (``InstanceRegistry.apply_view``),
which bumps ``members_version`` when they do; a view of new load figures keeps it);
a request then costs the policies' choices and the prefix index's look-ups. Partner
lists equal to a whole pool are that pool's list, one object (the usual case: every
pair usable), not a copy per engine. Which engines pair with every routable engine of
the other role (``_complete``) is worked out over every P × D only when the members or
the probes changed, and then, under the Controller's published pair checks (or none),
in O(P + D) from the peer versions' extremes (``_complete_by_versions``); a change of
the pools alone (an engine marked full or failed, or
its mark running out) then costs O(P + D) while every engine is complete.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .conditional import decide
from .errors import ServeError
from .instances import EngineEndpoint, InstanceRegistry, Pools
from .metrics import CoordinatorMetrics
from .pairs import PairChecks
from .policies import RouteContext, build_policy
from .prefix_index import PrefixIndex
from .settings import CoordinatorSettings


@dataclass
class Plan:
    kind: str  # "pd" | "single"
    prefill: EngineEndpoint | None = None
    decode: EngineEndpoint | None = None
    single: EngineEndpoint | None = None
    fallback: str | None = None  # reason label when this is a fallback

    def engines(self) -> list[EngineEndpoint]:
        return [e for e in (self.prefill, self.decode, self.single) if e is not None]


@dataclass
class Pairing:
    """``compatible``'s answer for one set of pools, and each engine's partners: the
    engines of the other pool it can pair with, in pool order."""

    prefill: list[EngineEndpoint]
    decode: list[EngineEndpoint]
    reason: str
    partners: dict[str, list[EngineEndpoint]] = field(default_factory=dict)


class Router:
    def __init__(self, settings: CoordinatorSettings, registry: InstanceRegistry,
                 index: PrefixIndex, metrics: CoordinatorMetrics,
                 pairs: PairChecks | None = None) -> None:
        """``pairs``: the probe results pairs must pass (None: pair on compat hash alone,
        for views fed by hand)."""
        self.settings = settings
        self.registry = registry
        self.pairs = pairs
        self.index = index
        self.metrics = metrics
        self.prefill_policy = build_policy(settings.prefill_policy, index, "prefill")
        self.decode_policy = build_policy(settings.decode_policy, index, "decode")
        self._pairing: Pairing | None = None
        self._pairing_key: tuple = ()
        self._pairing_members: tuple[EngineEndpoint, ...] = ()  # alive: the key's ids stay theirs
        self._complete_ids: set[str] = set()
        self._complete_key: tuple = ()

    async def plan(self, ctx: RouteContext, exclude: set[str], deadline: float,
                   prefer: Plan | None = None) -> Plan:
        """Called by the request lifecycle for each attempt; waits (queue) up to ``deadline``.
        ``prefer``: the plan of a sibling choice (``n > 1``), kept while its engines are
        routable, so this choice finds the prompt's blocks in their prefix caches."""
        if prefer is not None and self._still_usable(prefer, exclude):
            self._predict(prefer.prefill or prefer.single, ctx)  # its hits are counted too
            return Plan(prefer.kind, prefer.prefill, prefer.decode, prefer.single, prefer.fallback)
        counted = False
        stale_until = time.monotonic() + self.settings.suspect_s
        while True:
            pools = self.registry.pools(exclude)
            if self._only_failed(pools, exclude) and self.settings.controller:
                # The engines this request failed on are all its pools have: the
                # Controller hears of a dead engine within a heartbeat and falls back
                # to hybrid engines; wait for that (bounded) before trying them again.
                left = min(deadline, stale_until) - time.monotonic()
                if left > 0:
                    await self.registry.wait_changed(left)
                    continue
            plan, reason = self.plan_now(pools, ctx)
            if plan is not None:
                return plan
            policy = self.settings.fallback_policy
            detail = self.registry.fallback_reason or reason.replace("_", " ")
            colocated = self.is_colocated()  # the deployment, not a fallback
            if pools.hybrid and (colocated or policy == "hybrid"):
                inst = self.decode_policy.choose(pools.hybrid, ctx)
                self.metrics.routes.labels("hybrid", self.settings.decode_policy).inc()
                self._predict(inst, ctx)
                self.index.record(inst.instance_id, ctx.hashes)
                if colocated:
                    return Plan("single", single=inst)
                self.metrics.fallbacks.labels("hybrid", reason).inc()
                return Plan("single", single=inst, fallback=reason)
            if policy == "fail":
                self.metrics.fallbacks.labels("fail", reason).inc()
                raise ServeError(503, f"no engine pair to serve the request ({detail}); "
                                 "fallback policy is fail", code="no_route")
            if policy == "hybrid" and not self._may_change(exclude, reason):
                self.metrics.fallbacks.labels("hybrid", reason).inc()
                raise ServeError(503, f"no engine pair to serve the request ({detail}) and no "
                                 "hybrid engine to fall back to", code="no_route")
            if not counted:
                self.metrics.fallbacks.labels(policy, reason).inc()
                counted = True
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServeError(503, f"no engine pair became available within the deadline "
                                 f"({detail}); fallback policy is {policy}", code="no_route")
            self.metrics.queued_for_route.inc()
            try:
                await self.registry.wait_changed(left)
            finally:
                self.metrics.queued_for_route.dec()

    def _predict(self, prefilling: EngineEndpoint, ctx: RouteContext) -> None:
        """Counts the prompt tokens the index expects the prefilling engine to have cached
        (against what engines report: ``legs``), before this route is recorded. An engine
        computes at least the prompt's last token, so a whole-prompt match counts one
        block less."""
        blocks = min(self.index.match(prefilling.instance_id, ctx.hashes),
                     (ctx.num_tokens - 1) // ctx.block_size)
        self.metrics.prefix_predicted.inc(blocks * ctx.block_size)

    @staticmethod
    def _only_failed(pools: Pools, exclude: set[str]) -> bool:
        """Every route left goes through an engine this request already failed on
        (``pools`` hands those out only when nothing else is left): no prefill and decode
        pair, and no hybrid engine, without one."""
        if not exclude:
            return False
        fresh = {role: [i for i in getattr(pools, role) if i.instance_id not in exclude]
                 for role in ("prefill", "decode", "hybrid")}
        has_failed = any(i.instance_id in exclude
                         for role in ("prefill", "decode", "hybrid") for i in getattr(pools, role))
        return has_failed and not ((fresh["prefill"] and fresh["decode"]) or fresh["hybrid"])

    def _may_change(self, exclude: set[str], reason: str) -> bool:
        """Whether waiting may give the request a route: a Controller may switch engines
        to hybrid; without one, the pair checks retry a pair whose probe failed or is not
        done yet (``no_probed_pair``: a busy engine is not a dead one), and an engine of
        the view that is not routable now (down, draining) may come back. Excluded
        engines stay excluded for this request."""
        if self.settings.controller or reason == "no_probed_pair":
            return True
        return any(not i.routable for i in self.registry.all() if i.instance_id not in exclude)

    def _still_usable(self, plan: Plan, exclude: set[str]) -> bool:
        return all(self.registry.get(e.instance_id) is e and e.routable
                   and e.instance_id not in exclude for e in plan.engines())

    def is_colocated(self) -> bool:
        """A colocated deployment: the Controller says so, or (static view) no engine of
        the view is a prefill or decode engine. Its hybrid engines serve as the norm."""
        if self.registry.mode != "PD":
            return self.registry.mode == "COLOCATED"
        instances = self.registry.all()
        return bool(instances) and all(i.role in ("hybrid", "unknown") for i in instances)

    def can_pair(self, p: EngineEndpoint, d: EngineEndpoint) -> bool:
        """Equal compat hashes and, with pair checks, a probe of the pair that passed."""
        return p.kv_compat_hash == d.kv_compat_hash and (self.pairs is None or self.pairs.usable(p, d))

    def compatible(self, pools: Pools) -> tuple[list[EngineEndpoint], list[EngineEndpoint], str]:
        """The P and D candidates that can pair (``can_pair`` with some engine of the
        other pool), or a reason label. Also /ready's test. The lists are shared by
        every caller until the pairing changes: read them, never change them."""
        pairing = self.pairing(pools)
        return pairing.prefill, pairing.decode, pairing.reason

    def pairing(self, pools: Pools) -> Pairing:
        """``compatible``'s answer with each candidate's partners; the last one is kept
        (``Cost`` above) and built afresh when the registry, the pair checks or the
        pools' members changed."""
        key = (self.registry.members_version, self.pairs.version if self.pairs is not None else 0,
               pools.members)
        if key != self._pairing_key:
            self._pairing = self._build_pairing(pools)
            self._pairing_key = key
            self._pairing_members = (*pools.prefill, *pools.decode)
        return self._pairing

    def _build_pairing(self, pools: Pools) -> Pairing:
        if not pools.prefill and not pools.decode:
            return Pairing([], [], "no_prefill_or_decode_engine")
        if not pools.prefill:
            return Pairing([], [], "no_prefill_engine")
        if not pools.decode:
            return Pairing([], [], "no_decode_engine")
        common = {p.kv_compat_hash for p in pools.prefill} & {d.kv_compat_hash for d in pools.decode}
        if not common:
            return Pairing([], [], "no_compatible_pair")
        complete = self._complete()
        partners = {p.instance_id: pools.decode if p.instance_id in complete else
                    _whole([d for d in pools.decode if self.can_pair(p, d)], pools.decode)
                    for p in pools.prefill}
        partners.update({d.instance_id: pools.prefill if d.instance_id in complete else
                         _whole([p for p in pools.prefill if self.can_pair(p, d)], pools.prefill)
                         for d in pools.decode})
        prefill = _whole([p for p in pools.prefill if partners[p.instance_id]], pools.prefill)
        decode = _whole([d for d in pools.decode if partners[d.instance_id]], pools.decode)
        if not prefill:
            return Pairing([], [], "no_probed_pair")
        return Pairing(prefill, decode, "", partners)

    def _complete(self) -> set[str]:
        """The routable prefill and decode engines that pair with every routable engine of
        the other role; worked out afresh when the members or the probes changed."""
        key = (self.registry.members_version, self.pairs.version if self.pairs is not None else 0)
        if key != self._complete_key:
            routable = [i for i in self.registry.all() if i.routable]
            prefill = [i for i in routable if i.role == "prefill"]
            decode = [i for i in routable if i.role == "decode"]
            if self.pairs is None or self.pairs.is_published:
                complete = self._complete_by_versions(prefill, decode)
            else:
                complete = {p.instance_id for p in prefill if all(self.can_pair(p, d) for d in decode)}
                complete.update(d.instance_id for d in decode if all(self.can_pair(p, d) for p in prefill))
            self._complete_ids, self._complete_key = complete, key
        return self._complete_ids

    def _complete_by_versions(self, prefill: list[EngineEndpoint], decode: list[EngineEndpoint]) -> set[str]:
        """``_complete`` without a look at every P x D (1,000 engines: 187,500 pairs,
        290 ms on the first request after each change of the members, an engine's death
        among them): with no pair checks or the Controller's published ones, ``can_pair``
        reads compat hashes and peer versions, so an engine pairs with every one of the
        other role when the hashes are one, its version passes the other role's extreme,
        and no exception names it (a published unusable pair, or a failed re-probe of
        this Coordinator's, between routable engines). Exceptions are few; an engine they
        name is left out here, and the pairing then checks its pairs one by one."""
        named: set[str] = set()
        newest, oldest, least_listed = 0, float("inf"), 0  # no pair checks: the versions pass
        published = self.registry.published_pairs if self.pairs is not None else None
        if published is not None:
            prefill_ids, decode_at = {p.instance_id for p in prefill}, {d.instance_id: d for d in decode}
            failed = [pair for pair, result in self.pairs.probes.results.items()
                      if not result.ok and pair[1] in decode_at and result.kv_endpoint == decode_at[pair[1]].kv_endpoint]
            named.update(i for pair in (*published.unusable, *failed)
                         if pair[0] in prefill_ids and pair[1] in decode_at for i in pair)
            listed = [d.peers_listed_version for d in decode]
            newest = max(listed, default=0) if all(listed) else float("inf")  # an unlisted one pairs with none
            oldest = min((p.peers_checked_version for p in prefill), default=float("inf"))
            least_listed = 1
        prefill_hashes, decode_hashes = {p.kv_compat_hash for p in prefill}, {d.kv_compat_hash for d in decode}
        return ({p.instance_id for p in prefill  # its agent checked every decode engine
                 if decode_hashes <= {p.kv_compat_hash} and p.peers_checked_version >= newest}
                | {d.instance_id for d in decode  # every prefill engine's agent checked it
                   if prefill_hashes <= {d.kv_compat_hash}
                   and (not prefill or least_listed <= d.peers_listed_version <= oldest)}) - named

    def plan_now(self, pools: Pools, ctx: RouteContext) -> tuple[Plan | None, str]:
        """The PD plan for these pools, or (None, reason label). Called by ``plan``."""
        pairing = self.pairing(pools)
        if pairing.reason:
            return None, pairing.reason
        if self.settings.kv_mode == "pull":
            p = self.prefill_policy.choose(pairing.prefill, ctx)
            d = self.decode_policy.choose(pairing.partners[p.instance_id], ctx)
        else:  # decode first: D reserves its blocks before P writes into them
            d = self.decode_policy.choose(pairing.decode, ctx)
            p = self.prefill_policy.choose(pairing.partners[d.instance_id], ctx)
        s = self.settings
        cached = self.index.match(d.instance_id, ctx.hashes) * ctx.block_size
        decision = decide(p, d, ctx.num_tokens - cached, s.local_prefill_max_tokens,
                          s.load_aware_local_prefill, s.tpot_slo_s)
        self.metrics.prefill_decisions.labels(
            "decode" if decision.on_decode else "prefill", decision.reason).inc()
        if decision.on_decode:
            self.metrics.prefix_predicted.inc(cached)
            self.index.record(d.instance_id, ctx.hashes)
            self.metrics.local_prefills.inc()
            self.metrics.routes.labels("decode", s.decode_policy).inc()
            return Plan("single", single=d), ""
        self._predict(p, ctx)
        self.index.record(p.instance_id, ctx.hashes)
        self.index.record(d.instance_id, ctx.hashes)
        self.metrics.routes.labels("prefill", self.settings.prefill_policy).inc()
        self.metrics.routes.labels("decode", self.settings.decode_policy).inc()
        return Plan("pd", prefill=p, decode=d), ""


def _whole(part: list[EngineEndpoint], pool: list[EngineEndpoint]) -> list[EngineEndpoint]:
    """``pool`` itself when ``part`` holds all of it (``part`` keeps the pool's order)."""
    return pool if len(part) == len(pool) else part
