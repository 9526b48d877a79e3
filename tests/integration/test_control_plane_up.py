"""``pdserve up`` end to end: it comes up, serves, survives its own crash (the next
start clears the leftovers), and Ctrl-C stops every process it started."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx

from pdserve.cli import COMMANDS
from pdserve.local.runstate import is_group_alive
from tests.etcd import free_port
from tests.procs import PDSERVE, Proc


def completion(port: int) -> httpx.Response:
    base = f"http://127.0.0.1:{port}"
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    return httpx.post(f"{base}/v1/completions", timeout=60,
                      json={"model": model, "prompt": "Hello", "max_tokens": 8})


def test_up_serves_recovers_from_a_crash_and_stops_everything(tmp_path):
    port, run_dir = free_port(), tmp_path / "run"
    args = [*PDSERVE, "up", "--port", str(port), "--run-dir", str(run_dir)]
    procs: list[Proc] = []
    try:
        _lifecycle(args, port, run_dir, procs)
    finally:
        for proc in procs:
            proc.stop()


def _lifecycle(args, port, run_dir, procs: list[Proc]) -> None:
    first = Proc(args)
    procs.append(first)
    first.wait_for(r"pdserve is up", timeout_s=180)
    groups = json.loads((run_dir / "processes.json").read_text())["groups"]
    assert {"controller", "nodeagent"} <= set(groups)
    if "coordinator" in COMMANDS:
        deadline = time.monotonic() + 30
        while (r := completion(port)).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert r.status_code == 200, r.text

    os.kill(first.popen.pid, signal.SIGKILL)  # a crash: its children are left behind
    first.popen.wait()
    assert all(is_group_alive(g) for g in groups.values())

    second = Proc(args)
    procs.append(second)
    second.wait_for(r"stopped leftovers of an earlier run", timeout_s=30)
    assert not any(is_group_alive(g) for g in groups.values())
    second.wait_for(r"pdserve is up", timeout_s=180)
    groups = json.loads((run_dir / "processes.json").read_text())["groups"]
    second.popen.send_signal(signal.SIGINT)
    assert second.popen.wait(30) == 0
    assert not any(is_group_alive(g) for g in groups.values())
    assert not (run_dir / "processes.json").exists()
