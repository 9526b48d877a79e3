"""The operator's doctor: the cluster-level checks of ``pdserve doctor``
(``pdserve.runtime.doctor_checks.check_engines``) run in the background for each
Ready PDCluster, their findings written as its ``Doctor`` condition.

Owns ``DoctorRuns`` (one per operator, held by ``Reconciler``) and
``apply_doctor_condition`` (findings -> the condition; pure). The condition:

- Unknown, ``NotRunYet``: no run has finished for the cluster (since the operator
  started);
- True, ``ChecksPassed``: no check failed; warnings are listed in the message;
- False, ``ChecksFailed``: the message lists each failing check (``name: detail``),
  then the warnings.

Per cluster: idle -> running (one asyncio task) -> findings kept -> running ...
A reconcile pass calls ``start_if_due`` (event loop thread); a run starts when the
cluster is Ready and it just became Ready (or never ran since the operator
started), or the last run started ``INTERVAL_S`` ago. At most one run per cluster
at a time; each ends within ``DEADLINE_S`` (else its one finding says it timed
out). Passes never wait for a run: they write ``latest`` findings, so a run's
result shows on the pass after it ended (the resync timer's at the latest).
``forget`` (on finalize) cancels a run and drops the findings.

Thresholds: ``INTERVAL_S`` 60 s between runs, ``DEADLINE_S`` 30 s per run,
``MESSAGE_MAX_CHARS`` 4,000 (the condition's message is cut there).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from datetime import datetime

from pdserve.api.conditions import set_condition
from pdserve.api.proto import controller_pb2 as cpb
from pdserve.operator.status import parse_conditions
from pdserve.runtime.doctor_checks import FAIL, WARN, Check, check_engines
from pdserve.runtime.security import SecuritySettings

INTERVAL_S = 60.0
DEADLINE_S = 30.0
MESSAGE_MAX_CHARS = 4000
FORGET_WAIT_S = 5.0  # forget waits this long for a cancelled run to end

log = logging.getLogger(__name__)

ClusterKey = tuple[str, str]  # (namespace, name)
ChecksFn = Callable[[Sequence[cpb.InstanceView], SecuritySettings], Awaitable[list[Check]]]


def build_doctor_condition(findings: Sequence[Check] | None) -> tuple[str, str, str]:
    """(status, reason, message) of the ``Doctor`` condition; the rules are the module's."""
    if findings is None:
        return "Unknown", "NotRunYet", "the checks run once the cluster is Ready"
    failed = [f"{c.name}: {c.detail}" for c in findings if c.status == FAIL]
    warned = [f"{c.name}: {c.detail}" for c in findings if c.status == WARN]
    parts = [f"failed: {'; '.join(failed)}"] if failed else [f"{len(findings)} checks passed"]
    if warned:
        parts.append(f"warnings: {'; '.join(warned)}")
    message = ". ".join(parts)
    if len(message) > MESSAGE_MAX_CHARS:
        message = message[:MESSAGE_MAX_CHARS - 3] + "..."
    return ("False", "ChecksFailed", message) if failed else ("True", "ChecksPassed", message)


def apply_doctor_condition(status: dict, findings: Sequence[Check] | None, generation: int | None,
                           now: datetime) -> dict:
    """``status`` (a PDCluster status from ``status.build_status``) with the ``Doctor``
    condition set from ``findings``; the input is left alone. Called by reconcile."""
    conditions = set_condition(parse_conditions(status), "Doctor", *build_doctor_condition(findings),
                               generation, now)
    return {**status, "conditions": [c.to_manifest() for c in conditions]}


class DoctorRuns:
    """Background doctor runs, by cluster. All methods run on the operator's event loop."""

    def __init__(self, security: SecuritySettings | None = None, checks: ChecksFn = check_engines, *,
                 interval_s: float = INTERVAL_S, deadline_s: float = DEADLINE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._security = security or SecuritySettings()
        self._checks, self.interval_s, self.deadline_s, self._clock = checks, interval_s, deadline_s, clock
        self._tasks: dict[ClusterKey, asyncio.Task] = {}
        self._started: dict[ClusterKey, float] = {}
        self._findings: dict[ClusterKey, list[Check]] = {}
        self._ready: set[ClusterKey] = set()

    def latest(self, key: ClusterKey) -> list[Check] | None:
        """The findings of the last finished run, or None before the first."""
        return self._findings.get(key)

    def start_if_due(self, key: ClusterKey, is_ready: bool, instances: Sequence[cpb.InstanceView],
                     token: str) -> bool:
        """Called by each reconcile pass with the cluster's readiness, the Controller's
        routable instances and the cluster token (the engines' credential). Starts a
        run when one is due (the module's rules); returns whether it did. Never waits."""
        if not is_ready:
            self._ready.discard(key)
            return False
        became_ready = key not in self._ready
        self._ready.add(key)
        task = self._tasks.get(key)
        if task is not None and not task.done():
            return False
        started = self._started.get(key)
        if not became_ready and started is not None and self._clock() - started < self.interval_s:
            return False
        self._started[key] = self._clock()
        security = replace(self._security, token=token)
        self._tasks[key] = asyncio.create_task(self._run(key, tuple(instances), security),
                                               name=f"doctor {key[0]}/{key[1]}")
        return True

    async def _run(self, key: ClusterKey, instances: tuple[cpb.InstanceView, ...],
                   security: SecuritySettings) -> None:
        try:
            findings = await asyncio.wait_for(self._checks(instances, security), self.deadline_s)
        except TimeoutError:
            findings = [Check("doctor", FAIL, f"the checks did not finish within {self.deadline_s:g} s",
                              "see the engines' logs; run `pdserve doctor --controller ADDR`")]
        except Exception as exc:  # noqa: BLE001 - a broken check is a finding, not a crash
            log.warning("doctor run for %s/%s failed", *key, exc_info=True)
            findings = [Check("doctor", FAIL, f"the checks raised {exc!r}", "report it")]
        self._findings[key] = findings

    async def forget(self, key: ClusterKey) -> None:
        """Called by finalize: cancel the cluster's run, drop what is known of it."""
        task = self._tasks.pop(key, None)
        for known in (self._started, self._findings):
            known.pop(key, None)
        self._ready.discard(key)
        if task is not None:
            # bounded: a check that ignores its cancellation must not hold the finalizer
            task.cancel()
            await asyncio.wait({task}, timeout=FORGET_WAIT_S)

    async def close(self) -> None:
        """Called once when the operator stops."""
        for key in list(self._tasks):
            await self.forget(key)
