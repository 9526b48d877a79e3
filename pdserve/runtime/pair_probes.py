"""Pair probes: the last verdict on each (prefill, decode) KV path, and which are due.

One table of results keyed by (prefill id, decode id), shared by both places that
probe pairs: the Coordinator's pair checks (``coordinator/pairs.py``: every pair of a
static view, and under a Controller only the pairs of an engine that just failed a
leg) and the NodeAgent's peer checks (``nodeagent/peers.py``: its prefill engines
against the decode peers the Controller lists). Each caller says which pairs exist
and how one is asked (``ask``: the prefill engine's ProbePeer, whatever the backend);
this module says when a pair is due, runs the probes under one concurrency limit, and
keeps the verdicts.

    unknown ──probe ok──▶ usable ──probe failed / marked due──▶ re-probed
       │                     ▲                                     │
       └──probe failed──▶ unusable ◀───────────────────────────────┘

Thresholds: a usable pair is re-probed every ``interval_s``, or less often where that
would be more than ``max_reprobes_per_s`` re-probes a second (the interval stretched
to usable pairs / rate: one agent of a thousand pairs re-probes every 100 s at 10 a
second, not 33 a second; new and failed pairs are not held back); an unusable one every
``retry_s``; one marked due (``mark_due``) at the next round, keeping its last result
until the new one. A result is for the decode engine's KV endpoint it reached: at a
new endpoint the pair is unknown again. At most ``max_concurrency`` probes run at
once; each ends within ``timeout_s`` (the ``ask`` is given it).

Invariants: ``version`` grows whenever ``is_usable`` may answer differently (a
verdict, the endpoint it was reached at, a pair forgotten); one event loop owns it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (prefill instance id, decode instance id)
Ask = Callable[[], Awaitable[tuple[bool, str, float]]]  # -> (ok, reason, handshake seconds)


@dataclass(slots=True)  # one per P x D pair: 187,500 at 250 x 750 engines
class PairResult:
    ok: bool
    reason: str
    kv_endpoint: str  # D's KV endpoint the probe reached (a new one makes the pair unknown)
    checked_s: float  # monotonic time of the probe
    handshake_s: float = 0.0
    due: bool = False  # re-probe at the next round, whatever its age


class PairProbes:
    def __init__(self, interval_s: float = 30.0, retry_s: float = 2.0, timeout_s: float = 3.0,
                 max_concurrency: int = 8, max_reprobes_per_s: float = 10.0) -> None:
        if not all(v > 0 for v in (interval_s, retry_s, timeout_s, max_reprobes_per_s)):
            raise ValueError(f"pair probes: interval {interval_s}, retry {retry_s}, timeout {timeout_s} "
                             f"and re-probes per second {max_reprobes_per_s} must all be positive")
        self.interval_s, self.retry_s, self.timeout_s = interval_s, retry_s, timeout_s
        self.max_reprobes_per_s = max_reprobes_per_s
        self._limit = asyncio.Semaphore(max_concurrency)
        self.results: dict[Key, PairResult] = {}
        self._num_usable = 0  # results with ok, kept as they change
        self.version = 0
        self.num_probes = 0  # probes asked since start (benchmarks, metrics)

    def result(self, key: Key, kv_endpoint: str) -> PairResult | None:
        """The last result of the pair for D at ``kv_endpoint``, or None (unknown)."""
        result = self.results.get(key)
        return result if result is not None and result.kv_endpoint == kv_endpoint else None

    def is_usable(self, key: Key, kv_endpoint: str) -> bool:
        result = self.result(key, kv_endpoint)
        return result is not None and result.ok

    def is_due(self, key: Key, kv_endpoint: str, now_s: float) -> bool:
        result = self.result(key, kv_endpoint)
        return result is None or now_s >= self._expires_s(result, self.reprobe_s)

    @property
    def reprobe_s(self) -> float:
        """How old a usable pair's result gets before it is probed again: ``interval_s``,
        stretched so the usable pairs' re-probes stay within ``max_reprobes_per_s``."""
        return max(self.interval_s, self._num_usable / self.max_reprobes_per_s)

    def next_due_s(self) -> float:
        """Monotonic time the earliest known result's age runs out (inf: none known)."""
        reprobe_s = self.reprobe_s
        return min((self._expires_s(r, reprobe_s) for r in self.results.values()), default=float("inf"))

    def _expires_s(self, result: PairResult, reprobe_s: float) -> float:
        """Monotonic time ``result`` is due again (0: marked due): a usable pair's after
        ``reprobe_s`` (passed in: a scan over every result computes it once), a failed one's after ``retry_s``."""
        return 0.0 if result.due else result.checked_s + (reprobe_s if result.ok else self.retry_s)

    def mark_due(self, instance_id: str) -> int:
        """Every known pair of this engine is probed again at the next round; returns how many."""
        num = 0
        for (p_id, d_id), result in self.results.items():
            if instance_id in (p_id, d_id):
                result.due = True
                num += 1
        return num

    def forget(self, keys: Iterable[Key]) -> None:
        for key in keys:
            if (result := self.results.pop(key, None)) is not None:
                self._num_usable -= result.ok
                self.version += 1

    def usable_keys(self) -> set[Key]:
        return {key for key, r in self.results.items() if r.ok}

    async def probe(self, key: Key, kv_endpoint: str, ask: Ask) -> PairResult:
        """Ask one pair (under the concurrency limit) and keep its verdict."""
        async with self._limit:
            ok, reason, handshake_s = await ask()
        self.num_probes += 1
        old = self.results.get(key)
        if not ok and (old is None or old.ok or old.reason != reason):
            log.warning("pair %s -> %s unusable: %s", key[0], key[1], reason)
        elif ok and old is not None and not old.ok:
            log.info("pair %s -> %s usable again", key[0], key[1])
        result = self.results[key] = PairResult(ok, reason, kv_endpoint, time.monotonic(), handshake_s)
        self._num_usable += ok - (old is not None and old.ok)
        if old is None or old.ok != ok or old.kv_endpoint != kv_endpoint:
            self.version += 1
        return result
