"""``pdserve engine`` runs with glibc's malloc on transparent huge pages
(``pdserve.runtime.huge_pages``): the process re-executes itself with the tunable, keeps
its pid and arguments, and its memory lands on 2 MiB pages where the kernel allows."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.runtime.huge_pages import TUNABLE, huge_pages_env
from tests.procs import Proc, start_engine

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_the_tunable_is_added_once_beside_the_users_and_never_over_their_choice():
    assert huge_pages_env({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": TUNABLE}
    assert huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == (
        f"glibc.malloc.arena_max=2:{TUNABLE}")
    assert huge_pages_env({"GLIBC_TUNABLES": TUNABLE}) is None  # re-executed already
    assert huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None  # the user's
    assert huge_pages_env({"PDSERVE_HUGE_PAGES": "0"}) is None


def _engine(env: dict | None = None) -> Proc:
    return start_engine("--threads", "1", "--log-level", "WARNING", env=env)[0]


def _read(pid: int) -> tuple[str, int]:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    tunables = next((e.decode().split("=", 1)[1] for e in environ if e.startswith(b"GLIBC_TUNABLES=")), "")
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    huge_kib = next(int(line.split()[1]) for line in rollup if line.startswith("AnonHugePages"))
    return tunables, huge_kib


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
def test_the_engine_process_reexecutes_itself_onto_huge_pages_unless_turned_off():
    thp = THP_MODE.read_text() if THP_MODE.exists() else "[never]"
    on = _engine()
    try:
        tunables, huge_kib = _read(on.popen.pid)  # the same pid: exec replaced the image
        assert TUNABLE in tunables.split(":")
        if "[never]" not in thp:
            assert huge_kib > 0  # the KV cache and weights are on 2 MiB pages
    finally:
        on.stop(30)
    assert "pdserve engine stopped" in on.output
    off = _engine({"PDSERVE_HUGE_PAGES": "0"})
    try:
        tunables, huge_kib = _read(off.popen.pid)
        assert TUNABLE not in tunables
        if "[madvise]" in thp:
            assert huge_kib == 0
    finally:
        off.stop(30)
