"""The run directory of ``pdserve up``: which processes it started, so a later start
can clean up after a crash.

``processes.json`` lists the owner (the ``pdserve up`` pid) and every child's
process group; ``addresses.json`` where the run's components listen (the Controller's
gRPC address, the Coordinator's URL), for ``pdserve doctor -f``. Each child runs in its own session (group id = its pid), so one
``killpg`` stops it with everything it spawned.

Invariants: a group is killed only if its leader still runs a ``pdserve`` command
(a recycled pid is left alone); the file is rewritten after every spawn and
removed on a clean stop; a live owner means another ``pdserve up`` is running. A
clean stop goes group by group (``stop_in_order``); leftovers of a crashed run are
stopped all at once (``stop_groups``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path


def default_run_dir(cluster_name: str) -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/pdserve-{os.getuid()}"
    return Path(base) / "pdserve" / cluster_name


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def is_pdserve_process(pid: int) -> bool:
    return "pdserve" in _cmdline(pid)


class RunState:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "processes.json"
        self.addresses_path = run_dir / "addresses.json"
        self.groups: dict[str, int] = {}  # name -> process group id

    def read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def live_owner(self) -> int | None:
        """The pid of another ``pdserve up`` still running on this run dir, if any."""
        owner = self.read().get("owner")
        if owner and owner != os.getpid() and is_pdserve_process(owner):
            return owner
        return None

    def kill_stale(self, timeout_s: float = 10.0) -> list[str]:
        """Called at start: stop what a crashed run left behind. Returns their names."""
        groups = {n: g for n, g in self.read().get("groups", {}).items() if is_pdserve_process(g)}
        stop_groups(groups.values(), timeout_s)
        with contextlib.suppress(OSError):
            self.path.unlink()
        return sorted(groups)

    def add(self, name: str, pgid: int) -> None:
        self.groups[name] = pgid
        self._write()

    def remove(self, name: str) -> None:
        """A process of the run stopped on purpose (the planner's scale-down)."""
        self.groups.pop(name, None)
        self._write()

    def _write(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"owner": os.getpid(), "groups": self.groups}))
        tmp.replace(self.path)

    def write_addresses(self, **addresses: str) -> None:
        """Called by ``pdserve up`` as components start; merges into what is there."""
        merged = {**self.read_addresses(), **addresses}
        tmp = self.addresses_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(merged))
        tmp.replace(self.addresses_path)

    def read_addresses(self) -> dict[str, str]:
        """The live run's addresses ({} when none is running or recorded)."""
        try:
            return json.loads(self.addresses_path.read_text())
        except (OSError, ValueError):
            return {}

    def clear(self) -> None:
        for path in (self.path, self.addresses_path):
            with contextlib.suppress(OSError):
                path.unlink()


def stop_groups(pgids, timeout_s: float = 10.0) -> None:
    """SIGTERM every group, wait, then SIGKILL the ones still there."""
    pgids = list(pgids)
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(is_group_alive(g) for g in pgids):
        time.sleep(0.1)
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def stop_in_order(pgids, timeout_s: float = 20.0) -> None:
    """One group after the other: SIGTERM to its leader only, which stops its own
    children (the NodeAgent its engines, within 15 s) and exits; after ``timeout_s``
    whatever is left of the group is killed. Called by ``pdserve up`` on a clean stop."""
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and is_group_alive(pgid):
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def is_group_alive(pgid: int) -> bool:
    """True while a non-zombie process of the group runs (zombies may wait for a reaper)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # a zombie leader keeps the group "alive" for killpg until reaped by its parent
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pgid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            return any(_member_not_zombie(p, pgid) for p in os.listdir("/proc") if p.isdigit())
    return True


def _member_not_zombie(pid: str, pgid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].split()
    except OSError:
        return False
    return int(fields[2]) == pgid and fields[0] != "Z"
