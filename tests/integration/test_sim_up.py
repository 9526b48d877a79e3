"""``pdserve up`` with simulated engines (``spec.engine.simulate``): two prefill and two
decode engines without weights serve chat completions, plain and streamed, through the
Coordinator; every request crossed from a prefill engine into a decode engine over the
real KV handshake and transfer; no engine process loaded torch. With ``perProcess``,
several engines share a process, each still its own engine to the Controller and
Coordinator; a killed process's engines are routed around, then restarted together."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.api.proto import engine_pb2, engine_pb2_grpc
from pdserve.engine.sim import SIM_TEXT
from pdserve.local.runstate import is_group_alive
from tests.etcd import free_port
from tests.integration.test_up_spec import engine_pids, logs_of, write_yaml
from tests.procs import PDSERVE, Proc

NUM_REQUESTS = 8


def chat(base: str, i: int) -> str:
    """One chat completion, every other one streamed; returns its text."""
    body = {"model": "sim", "max_tokens": 10,
            "messages": [{"role": "user", "content": f"question {i}: " + "why? " * 20}]}
    if i % 2 == 0:
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 10
        return r.json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for choice in json.loads(line[len("data: "):])["choices"]:
            text += choice.get("delta", {}).get("content") or ""
    return text


def wait_for_every_pair_checked(base: str, num_pairs: int, timeout_s: float = 30) -> None:
    """Until the Coordinator's /ready lists ``num_pairs`` pairs, each usable as checked by
    the Controller (the prefill engines' agents probed it); fails with the pairs' reasons."""
    deadline = time.monotonic() + timeout_s
    while True:
        pairs = httpx.get(f"{base}/ready", params={"verbose": 1}, timeout=5).json()["pairs"]
        if len(pairs) == num_pairs and all(p["usable"] and p.get("checked_by") == "controller"
                                           for p in pairs):
            return
        assert time.monotonic() < deadline, [(p["prefill"], p["decode"], p.get("checked_by"),
                                              p["reason"]) for p in pairs]
        time.sleep(0.2)


def engine_stats_by_address(run_dir: Path) -> dict[str, engine_pb2.StatsResponse]:
    """Each engine's Stats by its address, asked of the engines the Controller's view lists."""
    token = (run_dir / "cluster-token").read_text()
    controller = re.search(r"controller serving on (\S+)",
                           (run_dir / "controller.log").read_text()).group(1)
    metadata = (("x-pdserve-token", token),)
    with grpc.insecure_channel(controller) as channel:
        view = pb_grpc.ControllerStub(channel).GetView(pb.WatchViewRequest(), timeout=5,
                                                       metadata=metadata)
    stats = {}
    for instance in view.instances:
        with grpc.insecure_channel(instance.engine_address) as channel:
            stats[instance.engine_address] = engine_pb2_grpc.EngineStub(channel).Stats(
                engine_pb2.StatsRequest(), timeout=5, metadata=metadata)
    return stats


def engine_stats(run_dir: Path) -> dict[str, list[engine_pb2.StatsResponse]]:
    """Each engine's Stats by role (``engine_stats_by_address``)."""
    stats: dict[str, list] = {}
    for s in engine_stats_by_address(run_dir).values():
        stats.setdefault(s.role, []).append(s)
    return stats


def up_simulated(tmp_path: Path, name: str, decode: int, prefill: int = 2,
                 **simulate) -> tuple[Proc, int, Path]:
    """``pdserve up -f`` of ``prefill`` simulated prefill engines and ``decode`` decode
    engines; returns the process, its port and its run directory."""
    spec = write_yaml(tmp_path / "cluster.yaml", {
        "model": {"preset": "small", "servedName": "sim"},
        "engine": {"kvCacheBytes": "64Mi", "simulate": {"prefillPerTokenMs": 0.1, **simulate}},
        "prefill": {"replicas": prefill, "threads": 1}, "decode": {"replicas": decode, "threads": 1},
        # Every request is disaggregated: no prompt is short enough to prefill on D.
        "routing": {"localPrefillMaxTokens": 0, "loadAwareLocalPrefill": False}}, name=name)
    port, run_dir = free_port(), tmp_path / "run"
    return Proc([*PDSERVE, "up", "-f", str(spec), "--port", str(port), "--run-dir", str(run_dir)]), port, run_dir


def test_up_serves_through_simulated_prefill_and_decode_engines(tmp_path):
    up, port, run_dir = up_simulated(tmp_path, "sim", decode=2)
    try:
        up.wait_for(r"starting cluster 'sim': model small in float32 \(auto\), simulated", timeout_s=30)
        up.wait_for(r"pdserve is up", timeout_s=120)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/ready", timeout=5).status_code == 200  # "up" is when it routes
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda i: chat(base, i), range(NUM_REQUESTS)))
        assert texts == [SIM_TEXT[:10]] * NUM_REQUESTS
        # every pair is probed by the prefill engines' agents and published by the Controller
        # ("up" needs one checked pair: the others may still be on their way)
        wait_for_every_pair_checked(base, 4)

        stats = engine_stats(run_dir)
        assert sorted(stats) == ["decode", "prefill"] and all(len(s) == 2 for s in stats.values())
        for role in ("prefill", "decode"):
            assert sum(s.kv_transfers_ok for s in stats[role]) == NUM_REQUESTS, stats[role]
            assert sum(s.kv_transfers_failed for s in stats[role]) == 0
        assert sum(s.kv_transfer_bytes for s in stats["prefill"]) > 0
        assert all(s.num_kv_blocks_total == 512 for ss in stats.values() for s in ss)  # small's

        groups = json.loads((run_dir / "processes.json").read_text())["groups"]
        pids = engine_pids(groups["nodeagent"])
        assert len(pids) == 4
        for pid in pids:
            assert b"--simulate" in Path(f"/proc/{pid}/cmdline").read_bytes()
            assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text()
        # the Controller ahead of every other process where it may be (root here)
        own, raised = os.getpriority(os.PRIO_PROCESS, 0), os.geteuid() == 0
        assert os.getpriority(os.PRIO_PROCESS, groups["controller"]) == (-10 if raised else own)
        assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in [*pids, groups["nodeagent"],
                                                                  groups["coordinator"]]} == {own}

        up.signal(signal.SIGINT)
        assert up.popen.wait(30) == 0
    finally:
        up.stop()
    assert not any(is_group_alive(g) for g in groups.values())
    assert "Traceback" not in up.output + logs_of(run_dir)


def num_routed(base: str, role: str) -> int:
    """Engines of ``role`` the Coordinator routes to now."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    m = re.search(rf'pdserve_coordinator_instances{{role="{role}"}} (\S+)', text)
    return int(float(m.group(1))) if m else -1


def until(predicate, timeout_s: float, what: str) -> float:
    """Seconds until ``predicate()`` held (polled); fails after ``timeout_s``."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - started


def test_engines_sharing_processes_serve_and_a_killed_process_is_routed_around(tmp_path):
    up, port, run_dir = up_simulated(tmp_path, "simpp", decode=4, perProcess=2)
    try:
        up.wait_for(r"pdserve is up", timeout_s=120)
        base = f"http://127.0.0.1:{port}"
        groups = json.loads((run_dir / "processes.json").read_text())["groups"]
        roles_of = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    for pid in engine_pids(groups["nodeagent"])}
        roles_of = {pid: argv[argv.index(b"--roles") + 1].decode() for pid, argv in roles_of.items()}
        assert sorted(roles_of.values()) == ["decode,decode", "decode,decode", "prefill,prefill"]
        stats = engine_stats(run_dir)  # six engines, each its own server
        assert {role: len(s) for role, s in stats.items()} == {"prefill": 2, "decode": 4}
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda i: chat(base, i), range(NUM_REQUESTS))) == [SIM_TEXT[:10]] * NUM_REQUESTS
        assert sum(s.kv_transfers_ok for s in engine_stats(run_dir)["decode"]) == NUM_REQUESTS

        victim = next(pid for pid, roles in roles_of.items() if roles == "decode,decode")
        os.kill(victim, signal.SIGKILL)
        until(lambda: num_routed(base, "decode") == 2, 10, "the killed process's two engines unrouted")
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda i: chat(base, i), range(NUM_REQUESTS))) == [SIM_TEXT[:10]] * NUM_REQUESTS
        until(lambda: num_routed(base, "decode") == 4, 30, "both engines back after one restart")
        restarted = set(engine_pids(groups["nodeagent"])) - set(roles_of)
        assert len(restarted) == 1, restarted  # one process for the two

        up.signal(signal.SIGINT)
        assert up.popen.wait(30) == 0
    finally:
        up.stop()
    assert not any(is_group_alive(g) for g in groups.values())
    assert "Traceback" not in up.output + logs_of(run_dir)
