"""The Controller at a thousand agents: two real Controllers on a real etcd, one agent per
engine as on Kubernetes, and Coordinators' real view watchers.

``sim_scale.py`` runs ``pdserve up``, where one NodeAgent supervises every engine: one
heartbeat a second carries all of them. On Kubernetes each engine Pod has its own
agent, so N engines are N heartbeats a second, each of one instance, into the leading
Controller. This script plays those N agents (the agent's wire: ``Heartbeat`` with one
report, the peer list version echoed, prefill engines reporting their peers checked;
no engine runs) from ``--agent-processes`` processes, against two ``pdserve
controller`` replicas on one etcd, and ``--coordinators`` of the Coordinator's own
``ControllerWatcher`` + ``InstanceRegistry`` (what a Coordinator runs on each view) in
one more process. For each N:

- registered: seconds from the agents' start to every watcher showing N instances;
- steady state over ``--seconds``: the leader's CPU (% of one core) and its CPU per
  heartbeat (its own ``heartbeat_cpu_seconds`` counter), heartbeats/s, the agents'
  heartbeat round trip p50/p99, etcd writes/s (the leader's count) and etcd's CPU, the
  stand-in Coordinators' CPU each, views/s and KiB per view each receives;
- an engine's exit (its agent reports ``exited`` at once, as the NodeAgent does):
  seconds until every watcher's registry has dropped it;
- an agent gone silent (its Pod lost): seconds until every watcher dropped its engine;
- the leader SIGKILLed: seconds until every watcher gets views again from the standby,
  and how many instances the new leader's view holds then and after one failure
  window (none of them should have been failed by the handover).

Rerun: .venv/bin/python benchmarks/controller_fanin.py --engines 100,300,1000 --json fanin.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import queue
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
from sim_scale import cpu_s  # this script's directory: run as a script, like it

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.runtime.ports import free_ports

PDSERVE = [sys.executable, "-m", "pdserve.cli"]
INTERVAL_S = 1.0  # the agents' heartbeat interval, the Controller's default
COUNTERS = ("heartbeats", "instance_reports", "heartbeat_cpu_seconds", "store_writes", "stalled_seconds")


# --- the agents ------------------------------------------------------------------
def report(iid: str, role: str, state: str, peers_version: int) -> pb.InstanceReport:
    n = int(iid.rsplit("-", 1)[1])
    rep = pb.InstanceReport(
        instance_id=iid, role=role, pool=role, process_state=state, probe_ok=state == "running",
        engine_address=f"10.{n // 250}.{n % 250}.1:7000", kv_endpoint=f"10.{n // 250}.{n % 250}.1:7001",
        kv_transport="tcp", model="sim", max_model_len=4096, checks_peers=True,
        load=pb.InstanceLoad(num_running=random.randint(0, 8), num_kv_blocks_free=1000))
    if role == "prefill":
        rep.peers_checked_version = peers_version  # its checks found every listed peer usable
    return rep


def agents_main(addresses: list[str], engines: list[tuple[str, str]], commands, results) -> None:
    asyncio.run(_agents(addresses, engines, commands, results))


async def _agents(addresses: list[str], engines: list[tuple[str, str]], commands, results) -> None:
    """One agent per engine, each on its own cadence; 16 connections per Controller."""
    channels = {a: [grpc.aio.insecure_channel(a) for _ in range(16)] for a in addresses}
    stubs = {a: [pb_grpc.ControllerStub(c) for c in cs] for a, cs in channels.items()}
    state = {iid: "running" for iid, _ in engines}
    wake = {iid: asyncio.Event() for iid, _ in engines}
    samples: list[tuple[float, float]] = []  # (sent, round trip s)
    leader, told = [0], [INTERVAL_S]

    async def agent(k: int, iid: str, role: str) -> None:
        peers_version, interval_s = 0, INTERVAL_S
        await asyncio.sleep(random.random() * INTERVAL_S)
        while True:
            if state[iid] != "silent":
                request = pb.HeartbeatRequest(agent_id=f"agent-{iid}", node=f"node-{iid}",
                                              instances=[report(iid, role, state[iid], peers_version)],
                                              peers_version=peers_version)
                for _ in addresses:
                    address = addresses[leader[0]]
                    sent = time.monotonic()
                    try:
                        reply = await stubs[address][k % 16].Heartbeat(request, timeout=2 * INTERVAL_S)
                    except grpc.aio.AioRpcError:
                        leader[0] = (leader[0] + 1) % len(addresses)
                        continue
                    samples.append((sent, time.monotonic() - sent))
                    if reply.HasField("peers"):
                        peers_version = reply.peers.version
                    if reply.heartbeat_interval_s > 0:  # the leader's (longer with many agents), as the NodeAgent
                        interval_s = reply.heartbeat_interval_s
                        told[0] = interval_s
                    break
            wake[iid].clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake[iid].wait(), interval_s)

    tasks = [asyncio.create_task(agent(k, iid, role)) for k, (iid, role) in enumerate(engines)]
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            await asyncio.sleep(0.02)
            continue
        if command[0] == "stop":
            break
        kind, iid = command
        state[iid] = kind  # "exited" (sent at once, as the NodeAgent does) or "silent"
        wake[iid].set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    results.put((samples, told[0]))


# --- the Coordinators' view watchers ------------------------------------------------
def watchers_main(address: str, num: int, commands, results) -> None:
    asyncio.run(_watchers(address, num, commands, results))


async def _watchers(address: str, num: int, commands, results) -> None:
    from pdserve.coordinator.instances import InstanceRegistry
    from pdserve.coordinator.watcher import ControllerWatcher
    from pdserve.runtime.security import SecuritySettings

    views: list[tuple[float, int, int]] = []  # (received, watcher, bytes)

    class Counting(ControllerWatcher):
        def apply(self, view: pb.ClusterView) -> None:
            views.append((time.monotonic(), self.index, view.ByteSize()))
            super().apply(view)

    registries = [InstanceRegistry(SecuritySettings()) for _ in range(num)]
    watchers = []
    for i, registry in enumerate(registries):
        watcher = Counting(registry, address, f"coordinator-{i}", SecuritySettings())
        watcher.index = i
        await watcher.start()
        watchers.append(watcher)
    gone_of: dict[str, float] = {}
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            for iid in [i for i, t in gone_of.items() if t == 0.0]:
                if all(not any(e.instance_id == iid for e in r.all()) for r in registries):
                    gone_of[iid] = time.monotonic()
                    results.put(("gone", iid, gone_of[iid]))
            await asyncio.sleep(0.01)
            continue
        if command[0] == "stop":
            break
        if command[0] == "count":
            results.put(("count", [len(r.all()) for r in registries]))
        elif command[0] == "views":
            results.put(("views", [v for v in views if v[0] >= command[1]]))
        elif command[0] == "watch_gone":
            gone_of[command[1]] = 0.0
    for watcher in watchers:
        await watcher.stop()


# --- one run -----------------------------------------------------------------------
class Proc:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if m := re.search(pattern, self.log.read_text(errors="replace")):
                return m
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log.name} exited:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{pattern!r} not in {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def counters(http: str) -> dict[str, float]:
    text = httpx.get(f"http://{http}/metrics", timeout=10).text
    found = {name: re.search(rf"^pdserve_controller_{name}_total (\S+)$", text, re.M) for name in COUNTERS}
    return {name: float(m.group(1)) if m else 0.0 for name, m in found.items()}


def is_leader(http: str) -> bool:
    try:
        return httpx.get(f"http://{http}/leaderz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def drain(results, kind: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            item = results.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if item[0] == kind:
            return item
    raise TimeoutError(f"no {kind!r} from the watchers in {timeout_s:g}s")


def wait_count(commands, results, want, timeout_s: float) -> float:
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        commands.put(("count",))
        counts = drain(results, "count", 10)[1]
        if want(counts):
            return time.monotonic() - began
        time.sleep(0.2)
    raise TimeoutError(f"watchers never showed the count wanted (last: {counts})")


def run_one(n: int, args, workdir: Path) -> dict:
    ctx = mp.get_context("spawn")
    run_dir = workdir / f"fanin-{n}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    client_port, peer_port = free_ports("127.0.0.1", 2)
    etcd = Proc(["etcd", "--name", "fanin", "--data-dir", str(run_dir / "etcd"),
                 "--listen-client-urls", f"http://127.0.0.1:{client_port}",
                 "--advertise-client-urls", f"http://127.0.0.1:{client_port}",
                 "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                 "--initial-cluster", f"fanin=http://127.0.0.1:{peer_port}", "--log-level", "error"],
                run_dir / "etcd.log")
    procs, workers = [etcd], []
    agent_commands = [ctx.Queue() for _ in range(args.agent_processes)]
    agent_results, watch_commands, watch_results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    result: dict = {"engines": n, "coordinators": args.coordinators}
    window = (0.0, 0.0)
    try:
        time.sleep(1.0)
        controllers = []
        for i in range(2):
            grpc_port, = free_ports("127.0.0.1", 1)
            proc = Proc([*PDSERVE, "controller", "--store", f"etcd://127.0.0.1:{client_port}",
                         "--host", "127.0.0.1", "--port", str(grpc_port),
                         "--advertise", f"127.0.0.1:{grpc_port}", "--no-rebalance", "--planner", "off"],
                        run_dir / f"controller-{i}.log")
            procs.append(proc)
            m = proc.wait_for(r"controller serving on (\S+) \(http (\S+),", 60)
            controllers.append((proc, m.group(1), m.group(2)))
        addresses = [c[1] for c in controllers]
        leader = next(c for c in controllers if is_leader(c[2]))
        num_prefill = max(1, n // 4)
        engines = [(f"fanin-prefill-{i}", "prefill") for i in range(num_prefill)]
        engines += [(f"fanin-decode-{i}", "decode") for i in range(n - num_prefill)]
        watchers = ctx.Process(target=watchers_main, args=(",".join(addresses), args.coordinators,
                                                           watch_commands, watch_results))
        watchers.start()
        workers.append(watchers)
        began = time.monotonic()
        owner = {}
        for w in range(args.agent_processes):
            mine = engines[w::args.agent_processes]
            owner.update({iid: w for iid, _ in mine})
            worker = ctx.Process(target=agents_main, args=(addresses, mine, agent_commands[w], agent_results))
            worker.start()
            workers.append(worker)
        wait_count(watch_commands, watch_results, lambda counts: min(counts) >= n, 300)
        result["registered_s"] = round(time.monotonic() - began, 1)
        time.sleep(args.settle_seconds)

        # steady state
        pids = {"leader": leader[0].proc.pid, "etcd": etcd.proc.pid, "coordinators": watchers.pid}
        cpu0, c0, t0 = {k: cpu_s(p) for k, p in pids.items()}, counters(leader[2]), time.monotonic()
        time.sleep(args.seconds)
        t1 = time.monotonic()
        window = (t0, t1)
        cpu1, c1 = {k: cpu_s(p) for k, p in pids.items()}, counters(leader[2])
        span = t1 - t0
        beats = c1["heartbeats"] - c0["heartbeats"]
        watch_commands.put(("views", t0))
        views = [v for v in drain(watch_results, "views", 30)[1] if v[0] <= t1]
        result["steady"] = {
            "leader_cpu_pct": round(100 * (cpu1["leader"] - cpu0["leader"]) / span, 1),
            "heartbeats_s": round(beats / span, 1),
            "cpu_ms_per_heartbeat": round(1000 * (c1["heartbeat_cpu_seconds"] - c0["heartbeat_cpu_seconds"])
                                          / max(1, beats), 3),
            "store_writes_s": round((c1["store_writes"] - c0["store_writes"]) / span, 2),
            "stalled_s": round(c1["stalled_seconds"] - c0["stalled_seconds"], 2),
            "etcd_cpu_pct": round(100 * (cpu1["etcd"] - cpu0["etcd"]) / span, 1),
            "coordinator_cpu_pct_each": round(100 * (cpu1["coordinators"] - cpu0["coordinators"])
                                              / span / args.coordinators, 1),
            "views_s_each": round(len(views) / span / args.coordinators, 2),
            "view_kib": round(statistics.mean(v[2] for v in views) / 1024, 1) if views else 0.0,
        }

        # an engine exits: its agent says so at once
        exited = engines[-1][0]
        watch_commands.put(("watch_gone", exited))
        t0 = time.monotonic()
        agent_commands[owner[exited]].put(("exited", exited))
        result["exit_unrouted_s"] = round(drain(watch_results, "gone", 30)[2] - t0, 3)
        # an agent goes silent
        silent = engines[-2][0]
        watch_commands.put(("watch_gone", silent))
        t0 = time.monotonic()
        agent_commands[owner[silent]].put(("silent", silent))
        result["silent_unrouted_s"] = round(drain(watch_results, "gone", 60)[2] - t0, 3)

        # the leader dies
        t0 = time.monotonic()
        leader[0].proc.send_signal(signal.SIGKILL)
        standby = next(c for c in controllers if c is not leader)
        deadline = t0 + 60
        while time.monotonic() < deadline and not is_leader(standby[2]):
            time.sleep(0.05)
        result["new_leader_after_s"] = round(time.monotonic() - t0, 2)
        watch_commands.put(("views", t0))
        t_view = time.monotonic()
        while time.monotonic() - t_view < 60:
            watch_commands.put(("views", t0))
            got = drain(watch_results, "views", 10)[1]
            seen = {w for _, w, _ in got}
            if len(seen) == args.coordinators:
                result["views_again_after_s"] = round(max(min(t for t, w2, _ in got if w2 == w) for w in seen) - t0, 2)
                break
            time.sleep(0.1)
        watch_commands.put(("count",))
        result["instances_after_failover"] = drain(watch_results, "count", 10)[1]
        time.sleep(12 * INTERVAL_S)  # a new leader's grace (10 intervals), then silence is judged
        watch_commands.put(("count",))
        result["instances_after_grace"] = drain(watch_results, "count", 10)[1]
        result["expected_instances"] = n - 2
        logs = "".join(c[0].log.read_text(errors="replace") for c in controllers)
        result["suspect_events"] = logs.count("-> SUSPECT")
    finally:
        for q in agent_commands:
            q.put(("stop",))
        samples = []
        for _ in range(args.agent_processes):
            with contextlib.suppress(queue.Empty):
                got, result["interval_told_s"] = agent_results.get(timeout=30)
                samples += got
        watch_commands.put(("stop",))
        for worker in workers:
            worker.join(20)
            if worker.is_alive():
                worker.kill()
        for proc in reversed(procs):
            proc.stop()
    steady = [s for t, s in samples if window[0] <= t <= window[1]]
    if steady:
        rtts = sorted(steady)
        result["heartbeat_rtt_ms"] = {"p50": round(1000 * rtts[len(rtts) // 2], 2),
                                      "p99": round(1000 * rtts[int(len(rtts) * 0.99)], 2)}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="100,300,1000", help="engine (agent) counts, comma separated")
    parser.add_argument("--coordinators", type=int, default=3, help="view watchers (Coordinators)")
    parser.add_argument("--agent-processes", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0, help="steady-state window")
    parser.add_argument("--settle-seconds", type=float, default=5.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pdserve-fanin-"))
    results = []
    for n in map(int, args.engines.split(",")):
        results.append(run_one(n, args, workdir))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
