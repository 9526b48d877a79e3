"""``pdserve up -f spec.yaml`` runs the whole spec, the user's way: a colocated cluster
(one hybrid engine, pinned to one core, one thread) served under the spec's model
name with the spec's routing policy, then Ctrl-C stops everything."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import httpx
import yaml

from pdserve.local.runstate import is_group_alive
from tests.etcd import free_port
from tests.procs import PDSERVE, Proc


def write_spec(path: Path, core: int) -> None:
    path.write_text(yaml.safe_dump({
        "apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
        "metadata": {"name": "up-spec"},
        "spec": {
            "model": {"preset": "tiny", "servedName": "mymodel"},
            "engine": {"dtype": "float32", "kvCacheBytes": "16Mi"},
            "prefill": {"replicas": 0}, "decode": {"replicas": 0},
            "hybrid": {"replicas": 1, "threads": 1, "cpuAffinity": [core]},
            "routing": {"decodePolicy": "round_robin"},
        }}))


def engine_pids(nodeagent_group: int) -> list[int]:
    """Engines run in the NodeAgent's process group."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().split(") ", 1)[1].split()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[2]) == nodeagent_group and b"engine" in cmdline:
            pids.append(int(entry))
    return pids


def test_up_runs_a_colocated_spec_with_its_model_name_policy_and_cores(tmp_path):
    core = max(os.sched_getaffinity(0))
    spec, port, run_dir = tmp_path / "cluster.yaml", free_port(), tmp_path / "run"
    write_spec(spec, core)
    up = Proc([*PDSERVE, "up", "-f", str(spec), "--host", "127.0.0.1", "--port", str(port),
               "--run-dir", str(run_dir)])
    try:
        up.wait_for(r"starting cluster 'up-spec': model tiny, 1 hybrid, colocated", timeout_s=30)
        up.wait_for(r"pdserve is up: http://127\.0\.0\.1:" + str(port), timeout_s=60)
        assert re.search(r"mode COLOCATED: hybrid 1/1 ready", up.output), up.output
        base = f"http://127.0.0.1:{port}"
        models = httpx.get(f"{base}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["mymodel"]
        r = httpx.post(f"{base}/v1/completions", timeout=30,
                       json={"model": "mymodel", "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["model"] == "mymodel"
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert re.search(r'routing_decisions_total\{policy="round_robin",pool="hybrid"\} 1\.0', metrics)

        groups = json.loads((run_dir / "processes.json").read_text())["groups"]
        pids = engine_pids(groups["nodeagent"])
        assert len(pids) == 1 and os.sched_getaffinity(pids[0]) == {core}
        argv = Path(f"/proc/{pids[0]}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--role") + 1] == b"hybrid"
        assert argv[argv.index(b"--threads") + 1] == b"1"

        up.popen.send_signal(signal.SIGINT)
        assert up.popen.wait(30) == 0
        assert not any(is_group_alive(g) for g in groups.values())
    finally:
        up.stop()
