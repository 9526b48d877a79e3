"""Supervision of one engine process: launch, read its address, restart with backoff.

Owned by the NodeAgent, one per instance, or one per group of simulated instances that
share a process (``num_engines`` of them, ``pdserve engine --roles``: the process prints
one serving line per engine, in the order of its roles, and is running once all did;
``addresses`` lists them in that order). Such a group lives, dies and restarts
together. The engine runs in the agent's process group (and dies with the agent:
PR_SET_PDEATHSIG), so stopping the agent's group stops its engines. With ``cpus`` the engine is pinned to those cores
(``sched_setaffinity`` in the child, before it runs a line of Python). States:
``starting`` (launched, address not printed yet), ``running``, ``exited`` (just
died), ``restarting`` (waiting out the backoff).

Why an engine died is kept: its exit code and the last lines of its output that
carry the error (``error_lines``; ``last_exit`` says both in one line, for
heartbeats). An engine that exits before serving twice in a row with the same
code and error line ``is_failing_to_start``: relaunching it will not help
(``pdserve up`` stops on it and shows the error).

Invariants: restarts wait ``base_s * 2**(n-1)`` capped at ``max_s``, where n counts
consecutive short-lived runs (a run longer than ``stable_after_s`` resets it);
``num_restarts`` counts every relaunch; ``stop`` reaps the process; after every
exit, before a relaunch, the dead engine's shared-memory KV segments are removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import glob
import logging
import os
import re
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.nodeagent.launch import EmbeddedLaunch
from pdserve.runtime.aio import wait_event

log = logging.getLogger(__name__)
ERROR_RE = re.compile(r"error|exception|fatal|killed|abort|denied|not found|no such|cannot", re.I)
NUM_TAIL_LINES = 200      # output lines of the current run kept for the error excerpt
NUM_ERROR_LINES = 12      # most lines an excerpt holds
# The shm transport's KV segments: /dev/shm/pdserve-kv-<engine pid>-<random>
# (pdserve/engine/kv_transfer/transport/shm.py, ShmTensor). An engine unlinks its
# own at a clean exit; one killed (or stopped by SIGTERM) leaves them behind.
SHM_SEGMENT_GLOB = "/dev/shm/pdserve-kv-{pid}-*"


@dataclass(frozen=True)
class Backoff:
    base_s: float = 0.5
    max_s: float = 30.0
    stable_after_s: float = 30.0

    def delay_s(self, num_consecutive: int) -> float:
        return min(self.max_s, self.base_s * 2 ** max(0, num_consecutive - 1))


# Resolved here, in the agent: the child between fork and exec only calls it (loading a
# library there can deadlock on a lock another thread of the agent held at the fork).
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _child_setup(cpus: tuple[int, ...]) -> Callable[[], None]:
    """The child's pre-exec step: die with the agent, then pin to ``cpus`` (if any)."""
    def setup() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


def error_excerpt(lines: list[str]) -> list[str]:
    """The last lines of an engine's output that carry its error: the last traceback
    (its tail), else the last line that reads like an error and what follows it,
    else the last few lines. At most ``NUM_ERROR_LINES``."""
    lines = [line for line in lines if line.strip()]
    tracebacks = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if tracebacks:
        return lines[tracebacks[-1]:][-NUM_ERROR_LINES:]
    errors = [i for i, line in enumerate(lines) if ERROR_RE.search(line)]
    start = errors[-1] if errors else len(lines) - 3
    return lines[max(0, start):][-NUM_ERROR_LINES:]


def error_line(excerpt: list[str]) -> str:
    """The one line that names the error: the last erroring line of the excerpt."""
    return next((line for line in reversed(excerpt) if ERROR_RE.search(line)),
                excerpt[-1] if excerpt else "")


def remove_shm_segments(pid: int) -> list[str]:
    """Unlink the shared-memory KV segments engine ``pid`` created; returns their paths.
    Called once the engine was reaped."""
    removed = []
    for path in glob.glob(SHM_SEGMENT_GLOB.format(pid=pid)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


class EngineProcess:
    def __init__(self, instance_id: str, command: Callable[[], tuple[list[str], dict[str, str]]],
                 backoff: Backoff, on_change: Callable[[], None], echo: bool = True,
                 cpus: tuple[int, ...] = (),
                 serving_address: Callable[[str], str | None] = EmbeddedLaunch.serving_address,
                 num_engines: int = 1) -> None:
        """``command()`` is called at each launch (the role may have changed): the argv,
        and what the engine's environment adds to the agent's. ``serving_address(line)``
        reads each output line: an engine's address once it serves, else None; the process
        serves ``num_engines`` engines."""
        self.instance_id, self._command, self.backoff = instance_id, command, backoff
        self._serving_address = serving_address
        self.cpus = tuple(cpus)
        self._on_change, self._echo = on_change, echo
        self.num_engines = num_engines
        self.state = "starting"
        self.addresses: list[str] = []          # of the engines serving, in the process's order
        self.pid: int | None = None
        self.num_restarts = 0
        self.last_exit = ""                    # "engine exited with code N: <error line>"
        self.last_exit_code: int | None = None
        self.error_lines: list[str] = []       # the error excerpt of the last run that exited
        self.num_same_start_failures = 0       # exits before serving in a row, same error
        self._failure_key: tuple[int, str] | None = None
        self._tail: deque[str] = deque(maxlen=NUM_TAIL_LINES)
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._skip_backoff = asyncio.Event()

    @property
    def is_failing_to_start(self) -> bool:
        """Two runs in a row exited before serving, with the same code and error line."""
        return self.num_same_start_failures >= 2

    def _set(self, state: str) -> None:
        self.state = state
        self._on_change()

    async def supervise(self) -> None:
        """The launch/restart loop; the agent runs it as a task until ``stop``."""
        num_short_runs = 0
        while not self._stopping:
            started = time.monotonic()
            self.addresses = []
            self._tail.clear()
            self._set("starting")
            argv, env = self._command()
            self._proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **env} if env else None, preexec_fn=_child_setup(self.cpus))
            self.pid = self._proc.pid
            log.info("%s: engine started (pid %d%s)", self.instance_id, self.pid,
                     f", cores {','.join(map(str, self.cpus))}" if self.cpus else "")
            await self._read_output(self._proc)
            code = await self._proc.wait()
            self._clean_up(self._proc.pid)
            if self._stopping:
                break
            self._record_exit(code, was_serving=bool(self.addresses))
            log.warning("%s: %s", self.instance_id, self.last_exit)
            self._set("exited")
            ran_s = time.monotonic() - started
            num_short_runs = 1 if ran_s >= self.backoff.stable_after_s else num_short_runs + 1
            delay = 0.0 if self._skip_backoff.is_set() else self.backoff.delay_s(num_short_runs)
            self._skip_backoff.clear()
            self._set("restarting")
            await wait_event(self._skip_backoff, delay)
            self._skip_backoff.clear()
            self.num_restarts += 1

    def _record_exit(self, code: int, was_serving: bool) -> None:
        self.last_exit_code = code
        self.error_lines = error_excerpt(list(self._tail))
        line = error_line(self.error_lines)
        self.last_exit = f"engine exited with code {code}" + (f": {line.strip()}" if line else "")
        if was_serving:
            self.num_same_start_failures, self._failure_key = 0, None
            return
        # Digits differ from run to run (timestamps, pids, ports) for one and the same error.
        key = (code, re.sub(r"\d+", "#", line))
        self.num_same_start_failures = self.num_same_start_failures + 1 if key == self._failure_key else 1
        self._failure_key = key

    def _clean_up(self, pid: int) -> None:
        if removed := remove_shm_segments(pid):
            log.info("%s: removed the dead engine's shared memory: %s", self.instance_id,
                     ", ".join(removed))

    async def _read_output(self, proc: asyncio.subprocess.Process) -> None:
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self._tail.append(line)
            if self._echo:
                print(f"[{self.instance_id}] {line}", flush=True)
            if len(self.addresses) < self.num_engines and (address := self._serving_address(line)):
                self.addresses.append(address)
                if len(self.addresses) == self.num_engines:
                    self.num_same_start_failures, self._failure_key = 0, None
                    self._set("running")

    @property
    def address(self) -> str:
        """The (first) engine's address while it serves, else ""."""
        return self.addresses[0] if self.addresses else ""

    def kill(self) -> None:
        """Called for a Controller ``restart`` command: kill now, relaunch without backoff
        (every engine of the process)."""
        self._skip_backoff.set()
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()

    async def stop(self, timeout_s: float = 15.0) -> None:
        """Called on agent shutdown: SIGTERM, then SIGKILL after ``timeout_s`` (longer than
        the engine's default ``--shutdown-grace-s``, 10 s, for requests in flight); the
        process is reaped and its shared memory removed."""
        self._stopping = True
        self._skip_backoff.set()
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        self._clean_up(proc.pid)
