"""Supervision of one engine process: launch, read its address, restart with backoff.

Owned by the NodeAgent, one per instance. The engine runs in the agent's process
group (and dies with the agent: PR_SET_PDEATHSIG), so stopping the agent's group
stops its engines. With ``cpus`` the engine is pinned to those cores
(``sched_setaffinity`` in the child, before it runs a line of Python). States:
``starting`` (launched, address not printed yet), ``running``, ``exited`` (just
died), ``restarting`` (waiting out the backoff).

Invariants: restarts wait ``base_s * 2**(n-1)`` capped at ``max_s``, where n counts
consecutive short-lived runs (a run longer than ``stable_after_s`` resets it);
``num_restarts`` counts every relaunch; ``stop`` reaps the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)
ADDRESS_RE = re.compile(r"serving model .* on (\S+:\d+)")


@dataclass(frozen=True)
class Backoff:
    base_s: float = 0.5
    max_s: float = 30.0
    stable_after_s: float = 30.0

    def delay_s(self, num_consecutive: int) -> float:
        return min(self.max_s, self.base_s * 2 ** max(0, num_consecutive - 1))


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _child_setup(cpus: tuple[int, ...]) -> Callable[[], None]:
    """The child's pre-exec step: die with the agent, then pin to ``cpus`` (if any)."""
    def setup() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


class EngineProcess:
    def __init__(self, instance_id: str, argv: Callable[[], list[str]], backoff: Backoff,
                 on_change: Callable[[], None], echo: bool = True,
                 cpus: tuple[int, ...] = ()) -> None:
        """``argv()`` is called at each launch (the role may have changed)."""
        self.instance_id, self._argv, self.backoff = instance_id, argv, backoff
        self.cpus = tuple(cpus)
        self._on_change, self._echo = on_change, echo
        self.state = "starting"
        self.address = ""
        self.pid: int | None = None
        self.num_restarts = 0
        self.last_exit = ""
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._skip_backoff = asyncio.Event()

    def _set(self, state: str) -> None:
        self.state = state
        self._on_change()

    async def supervise(self) -> None:
        """The launch/restart loop; the agent runs it as a task until ``stop``."""
        num_short_runs = 0
        while not self._stopping:
            started = time.monotonic()
            self.address = ""
            self._set("starting")
            self._proc = await asyncio.create_subprocess_exec(
                *self._argv(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                preexec_fn=_child_setup(self.cpus))
            self.pid = self._proc.pid
            log.info("%s: engine started (pid %d%s)", self.instance_id, self.pid,
                     f", cores {','.join(map(str, self.cpus))}" if self.cpus else "")
            await self._read_output(self._proc)
            code = await self._proc.wait()
            if self._stopping:
                break
            self.last_exit = f"engine exited with code {code}"
            log.warning("%s: %s", self.instance_id, self.last_exit)
            self._set("exited")
            ran_s = time.monotonic() - started
            num_short_runs = 1 if ran_s >= self.backoff.stable_after_s else num_short_runs + 1
            delay = 0.0 if self._skip_backoff.is_set() else self.backoff.delay_s(num_short_runs)
            self._skip_backoff.clear()
            self._set("restarting")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._skip_backoff.wait(), delay)
            self._skip_backoff.clear()
            self.num_restarts += 1

    async def _read_output(self, proc: asyncio.subprocess.Process) -> None:
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if self._echo:
                print(f"[{self.instance_id}] {line}", flush=True)
            m = ADDRESS_RE.search(line)
            if m and not self.address:
                self.address = m.group(1)
                self._set("running")

    def kill(self) -> None:
        """Called for a Controller ``restart`` command: kill now, relaunch without backoff."""
        self._skip_backoff.set()
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Called on agent shutdown: SIGTERM, then SIGKILL; the process is reaped."""
        self._stopping = True
        self._skip_backoff.set()
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
