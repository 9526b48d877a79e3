"""``runtime/cpu_priority.py``: a process raises its own CPU priority where it may, and
keeps it (and says so) where it may not. Each case runs in a child process: a nice
value, once lowered, cannot be raised back by an unprivileged process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.runtime.cpu_priority import keep_off

CHILD = """
import logging, os, sys
from pdserve.runtime.cpu_priority import set_nice
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
before = set_nice(-3, "controller")
print("before", before, "now", os.getpriority(os.PRIO_PROCESS, 0))
"""


def run_child(*prefix: str) -> str:
    return subprocess.run([*prefix, sys.executable, "-c", CHILD], capture_output=True, text=True,
                          check=True, timeout=60).stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root (these machines run tests as root)")
def test_a_raise_is_taken_where_permitted():
    own = os.getpriority(os.PRIO_PROCESS, 0)
    out = run_child()
    assert f"before {own} now -3" in out and "controller: CPU priority nice -3" in out


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping a capability needs root")
def test_without_the_privilege_the_priority_is_kept_and_said_so():
    own = os.getpriority(os.PRIO_PROCESS, 0)
    out = run_child("setpriv", "--bounding-set", "-sys_nice")  # root without CAP_SYS_NICE
    assert f"before {own} now {own}" in out
    assert f"controller: CPU priority kept at nice {own}: nice -3 needs root or CAP_SYS_NICE" in out


def test_a_process_kept_off_the_engines_cores_runs_on_the_rest():
    cores = os.sched_getaffinity(0)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        engine = {max(cores)}
        got = keep_off(engine, "coordinator", child.pid)
        rest = cores - engine
        # On a one-core machine nothing is left beside the engine: the process stays as it is.
        assert got == (rest or None)
        assert os.sched_getaffinity(child.pid) == (rest or cores)
        assert keep_off(cores, "coordinator", child.pid) is None  # every core an engine's
        assert keep_off((), "coordinator", child.pid) is None  # no engine pinned
        assert os.sched_getaffinity(child.pid) == (rest or cores)
    finally:
        child.kill()
        child.wait()
    assert keep_off({max(cores)} if len(cores) > 1 else (), "coordinator", child.pid) is None  # gone
