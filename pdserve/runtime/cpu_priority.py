"""A control-plane process's CPU priority and cores on a host it shares with engines.

On ``pdserve up`` every component shares the host's cores with the engines, and under
load the engines and the Coordinator keep them busy: the Controller (tens of
milliseconds a second) then waits its turn behind dozens of busy processes. Measured
at 1,000 simulated engines on two cores: in some runs its loop stalled for seconds,
judged every engine silent, fell back to hybrid serving and lost its own leadership
lease. Its work is small and on the failover path, so ``pdserve up`` runs it ahead of
the rest (a lower nice value), as a kubelet's own daemons get reserved CPU; on
Kubernetes each component runs in a Pod of its own, with its CPU request. The
NodeAgent is left as it is: raised too, its probes of 1,000 engines took a fifth of the
engines' throughput there.

A raise needs root or ``CAP_SYS_NICE``: without it the process keeps its priority
and says so once. Called at start, before any thread: Linux keeps a nice value per
thread, and a thread inherits its creator's.

Cores: where the spec pins engines to cores (a pool's ``cpuAffinity``), ``pdserve up``
runs the Controller, the Coordinator, the KV pool and the NodeAgents on the other cores
(``keep_off``), if there are any: a pinned engine then has its cores to itself. With
SmolLM2 on one pinned core, the Coordinator, Controller and NodeAgent otherwise took
9-13% of that core at 32 streams (their share of the scheduler's picks).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

log = logging.getLogger(__name__)


def set_nice(nice: int | None, component: str) -> int:
    """Run this process at ``nice`` (None: as it is). Returns its nice value before."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if nice is None or nice == before:
        return before
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        log.info("%s: CPU priority nice %d (was %d)", component, nice, before)
    except PermissionError:
        log.info("%s: CPU priority kept at nice %d: nice %d needs root or CAP_SYS_NICE",
                    component, before, nice)
    return before



def keep_off(engine_cores: Iterable[int], component: str, pid: int = 0) -> set[int] | None:
    """Run process ``pid`` (0: this one) on the cores this process may use less
    ``engine_cores``; the cores it runs on, or None where it is left as it is (no engine
    pinned, or no core would be left)."""
    pinned = set(engine_cores)
    spare = os.sched_getaffinity(0) - pinned
    if not pinned or not spare:
        return None
    try:
        os.sched_setaffinity(pid, spare)
    except ProcessLookupError:  # it exited already: its own start-up says why
        return None
    log.info("%s: on cores %s, off the engines' cores %s", component, sorted(spare), sorted(pinned))
    return spare
