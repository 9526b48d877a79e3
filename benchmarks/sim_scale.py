"""The control plane against the number of engines: simulated engines on ``pdserve up``.

A ``pdserve up -f`` cluster of N simulated engines (``spec.engine.simulate``: the real
server, scheduler, KV handshake and heartbeats, the model's time slept; half prefill,
half decode, or ``--prefill`` P of them prefill) with its Controller, NodeAgent and one
Coordinator; ``--per-process K`` serves K engines of a pool per process
(``simulate.perProcess``). For each N:

- up: seconds from ``pdserve up`` to "pdserve is up", to the Coordinator's /ready (a
  pair checked) and to every P x D pair usable (``/ready?verbose=1``);
- memory: resident MiB of each component once up, the engines' per engine (all engine
  processes together over N), and the cluster's threads;
- idle: CPU (% of one core) of each component over ``--idle-seconds`` with no traffic,
  the engines' as their mean;
- the Controller, idle and under load (its ``pdserve_controller_*`` counters): heartbeats
  and instance reports per second, CPU milliseconds per heartbeat (its handling) and
  state store writes per second (the writes etcd would take; ``pdserve up`` runs the
  in-memory store), and the writes of the whole start-up;
- load: ``pdserve bench`` closed loop (``--concurrency`` streams of 256 -> 32 tokens) for
  ``--load-seconds``: requests/s, errors, the Coordinator's CPU milliseconds per request;
- kill: one decode engine process (with ``--per-process`` K its K engines) SIGKILLed
  under the same load: seconds until the Coordinator routes to none of its engines
  (its decode pool, as /ready counts it, that much lower: they left its view, or are
  suspect as their sessions ended), and the client errors meanwhile.

The load client runs on the same cores as the cluster: figures are for comparing N
with N, not absolutes.

Rerun: .venv/bin/python benchmarks/sim_scale.py --engines 8,32,100 --json scale.json
  (one engine per process), or with shared processes:
  .venv/bin/python benchmarks/sim_scale.py --engines 100,300 --per-process 10 --json scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

PDSERVE = [sys.executable, "-m", "pdserve.cli"]
TICK_S = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
COMPONENTS = ("coordinator", "controller", "nodeagent", "engine")


def spec(num_engines: int, per_process: int, num_prefill: int | None) -> dict:
    half = num_engines - num_prefill if num_prefill else num_engines // 2
    return {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster", "metadata": {"name": "scale"},
            "spec": {"model": {"preset": "small", "servedName": "sim"},
                     "engine": {"kvCacheBytes": "64Mi", "simulate": {"perProcess": per_process}},
                     "prefill": {"replicas": num_engines - half, "threads": 1},
                     "decode": {"replicas": half, "threads": 1}}}


def pids(root: int) -> dict[str, list[int]]:
    """The cluster's processes (``root``'s descendants) by component."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found: dict[str, list[int]] = {c: [] for c in COMPONENTS}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            text = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for component in COMPONENTS:
            if f"pdserve.cli {component} " in text:
                found[component].append(pid)
    return found


def cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK_S


def rss_mib(pid: int) -> float:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_BYTES / 2**20
    except OSError:
        return 0.0


def num_threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def num_engines_in(pid: int) -> int:
    """Engines one engine process serves (``--roles``: one per role listed)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return argv[argv.index(b"--roles") + 1].count(b",") + 1 if b"--roles" in argv else 1


def decode_instances(url: str) -> int:
    """Decode engines the Coordinator routes to now (its pools, as /ready counts them: the
    ``pdserve_coordinator_instances`` gauge without rendering every engine's series,
    which at 1,000 engines every 20 ms would load the Coordinator it measures)."""
    return httpx.get(url + "/ready", timeout=5).json()["detail"]["decode"]


CONTROLLER_COUNTERS = ("heartbeats", "instance_reports", "heartbeat_cpu_seconds", "store_writes", "stalled_seconds")


def agent_report(run_dir: Path) -> dict:
    """The NodeAgent's heartbeats so far (its /metrics): mean round trip, and the time from
    seeing the kill's exit to the Controller accepting the heartbeat that carried it (an
    older build without these reads nothing)."""
    found = re.search(r"\(http port (\d+),", (run_dir / "nodeagent.log").read_text(errors="replace"))
    if not found:
        return {}
    text = httpx.get(f"http://127.0.0.1:{found.group(1)}/metrics", timeout=10).text
    values = {name: float(m.group(1)) for name in ("heartbeats_total", "heartbeat_seconds_total", "exit_reports_total",
                                                   "exit_report_seconds_total", "exit_report_max_seconds")
              if (m := re.search(rf"^pdserve_nodeagent_{name} (\S+)$", text, re.M))}
    if len(values) < 5 or not values["heartbeats_total"]:
        return {}
    return {"agent_heartbeat_ms": round(1000 * values["heartbeat_seconds_total"] / values["heartbeats_total"], 1),
            "agent_exit_report_s": round(values["exit_report_max_seconds"], 3)}


def controller_counters(http: str) -> dict[str, float]:
    """The Controller's heartbeat and store counters, read from its /metrics (one an
    older build does not export reads 0: A/B runs against it)."""
    text = httpx.get(f"http://{http}/metrics", timeout=5).text
    found = {name: re.search(rf"^pdserve_controller_{name}_total (\S+)$", text, re.M) for name in CONTROLLER_COUNTERS}
    return {name: float(m.group(1)) if m else 0.0 for name, m in found.items()}


def controller_rates(before: dict, after: dict, seconds: float) -> dict:
    """Per second, and the CPU per heartbeat, between two ``controller_counters``."""
    delta = {k: after[k] - before[k] for k in CONTROLLER_COUNTERS}
    return {"heartbeats_s": round(delta["heartbeats"] / seconds, 2),
            "reports_s": round(delta["instance_reports"] / seconds, 1),
            "cpu_ms_per_heartbeat": round(1000 * delta["heartbeat_cpu_seconds"] / max(1, delta["heartbeats"]), 3),
            "store_writes_s": round(delta["store_writes"] / seconds, 2),
            "stalled_s": round(delta["stalled_seconds"], 2)}


def all_pairs_usable(url: str) -> bool:
    pairs = httpx.get(url + "/ready", params={"verbose": 1}, timeout=30).json()["pairs"]
    return bool(pairs) and all(p["usable"] for p in pairs)


def bench(url: str, seconds: float, concurrency: int) -> dict:
    out = subprocess.run([*PDSERVE, "bench", "--base-url", url, "--prompt-tokens", "256",
                          "--output-tokens", "32", "--concurrency", str(concurrency),
                          "--duration", str(seconds)], capture_output=True, text=True,
                         timeout=seconds + 120)
    row = re.search(r"^default\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)", out.stdout, re.M)
    if row is None:
        raise RuntimeError(f"no result from pdserve bench:\n{out.stdout}\n{out.stderr}")
    sent, ok, errors, rate = row.groups()
    return {"sent": int(sent), "ok": int(ok), "errors": int(errors), "req_s": float(rate)}


def run_one(n: int, args, workdir: Path) -> dict:
    spec_file, run_dir = workdir / f"scale-{n}.yaml", workdir / f"run-{n}"
    spec_file.write_text(yaml.safe_dump(spec(n, args.per_process, args.prefill)))
    url = f"http://127.0.0.1:{args.port}"
    began = time.monotonic()
    up = subprocess.Popen([*PDSERVE, "up", "-f", str(spec_file), "--port", str(args.port),
                           "--run-dir", str(run_dir)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    result: dict = {"engines": n, "per_process": args.per_process,
                    "prefill": args.prefill or n - n // 2}
    try:
        for line in up.stdout:
            if "pdserve is up" in line:
                break
        else:
            raise RuntimeError(f"{n} engines: pdserve up ended before it was up")
        result["up_s"] = round(time.monotonic() - began, 1)
        while httpx.get(url + "/ready", timeout=30).status_code != 200:  # a pair's KV path answered
            time.sleep(0.1)
        result["ready_s"] = round(time.monotonic() - began, 1)
        while not all_pairs_usable(url):
            time.sleep(0.2)
        result["pairs_s"] = round(time.monotonic() - began, 1)
        threading.Thread(target=lambda: [None for _ in up.stdout], daemon=True).start()
        procs = pids(up.pid)
        http = re.search(r"controller serving on \S+ \(http (\S+),", (run_dir / "controller.log").read_text()).group(1)
        result["startup_store_writes"] = int(controller_counters(http)["store_writes"])
        result["engine_processes"] = len(procs["engine"])

        time.sleep(5)  # past start-up's probes
        rss = {c: sum(map(rss_mib, procs[c])) for c in COMPONENTS}
        rss["engine"] /= n  # per engine
        result["rss_mib"] = {c: round(v, 2) for c, v in rss.items()}
        result["threads"] = sum(num_threads(p) for ps in procs.values() for p in ps)
        before, counted = {p: cpu_s(p) for ps in procs.values() for p in ps}, controller_counters(http)
        time.sleep(args.idle_seconds)
        used = {p: cpu_s(p) - before[p] for p in before}
        result["controller_idle"] = controller_rates(counted, controller_counters(http), args.idle_seconds)
        idle = {c: 100 * sum(used[p] for p in procs[c]) / args.idle_seconds for c in COMPONENTS}
        idle["engine"] /= n  # per engine
        result["idle_cpu_pct"] = {c: round(v, 2) for c, v in idle.items()}

        coordinator = procs["coordinator"][0]
        start, counted, began_load = cpu_s(coordinator), controller_counters(http), time.monotonic()
        load = bench(url, args.load_seconds, args.concurrency)
        result["controller_load"] = controller_rates(counted, controller_counters(http), time.monotonic() - began_load)
        load["coordinator_cpu_ms_per_request"] = round(
            1000 * (cpu_s(coordinator) - start) / max(1, load["ok"]), 2)
        result["load"] = load

        engines_before = pids(up.pid)["engine"]
        victim = next(p for p in engines_before
                      if b"--role\0decode" in Path(f"/proc/{p}/cmdline").read_bytes())
        # every decode engine routable again before the kill (a count taken while a late
        # heartbeat had the engines SUSPECT would never drop by the killed ones)
        num_decode, num_killed = n - result["prefill"], num_engines_in(victim)
        deadline = time.monotonic() + 60
        while decode_instances(url) < num_decode and time.monotonic() < deadline:
            time.sleep(0.2)
        kill: dict = {"engines": num_killed}

        def killer() -> None:
            time.sleep(args.load_seconds / 3)
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            while time.monotonic() - killed_at < 30:
                if decode_instances(url) <= num_decode - num_killed:
                    kill["unrouted_after_s"] = round(time.monotonic() - killed_at, 3)
                    return
                time.sleep(0.02)

        thread = threading.Thread(target=killer)
        thread.start()
        under_kill = bench(url, args.load_seconds, args.concurrency)
        thread.join()
        kill.update(errors=under_kill["errors"], ok=under_kill["ok"])
        kill.update(agent_report(run_dir))
        result["kill"] = kill
        log = (run_dir / "controller.log").read_text(errors="replace")
        # whole-cluster silences: each is every instance of the agent turning SUSPECT
        result["controller_log"] = {"suspect": log.count("-> SUSPECT"), "fallback": log.count("mode PD -> FALLBACK")}
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="8,32,100", help="engine counts, comma separated")
    parser.add_argument("--per-process", type=int, default=1,
                        help="simulated engines per process (spec.engine.simulate.perProcess)")
    parser.add_argument("--prefill", type=int, default=None,
                        help="prefill engines of each N, the rest decode (default: half); every P/D "
                             "pair is probed and holds a KV link, so P x D bounds what fits")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--load-seconds", type=float, default=30.0)
    parser.add_argument("--port", type=int, default=8799)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pdserve-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for n in (int(x) for x in args.engines.split(",")):
        results.append(run_one(n, args, workdir))
        print(json.dumps(results[-1]), flush=True)
    print("\n| engines | processes | up / ready / all pairs s | RSS MiB: coordinator / controller / nodeagent / per engine "
          "| idle CPU %: coordinator / controller / nodeagent / per engine "
          "| req/s | errors | Coordinator CPU ms/request | kill: engines, unrouted after s | errors |")
    print("|---:|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        m, i, load, kill = r["rss_mib"], r["idle_cpu_pct"], r["load"], r["kill"]
        print(f"| {r['engines']} | {r['engine_processes']} | {r['up_s']} / {r['ready_s']} / {r['pairs_s']} | {m['coordinator']:.0f} / "
              f"{m['controller']:.0f} / {m['nodeagent']:.0f} / {m['engine']:.1f} | {i['coordinator']} / "
              f"{i['controller']} / {i['nodeagent']} / {i['engine']} | {load['req_s']} | {load['errors']} | "
              f"{load['coordinator_cpu_ms_per_request']} | {kill['engines']}, "
              f"{kill.get('unrouted_after_s', 'never')} | {kill['errors']} |"
              + (f" agent: heartbeat {kill['agent_heartbeat_ms']} ms on average, the exit accepted after "
                 f"{kill['agent_exit_report_s']} s" if "agent_exit_report_s" in kill else ""))
    print("\n| engines | start-up store writes | Controller idle: heartbeats/s, reports/s, CPU ms/heartbeat, "
          "store writes/s | under load: the same |")
    print("|---:|---:|---|---|")
    for r in results:
        cells = [", ".join(str(r[k][f]) for f in ("heartbeats_s", "reports_s", "cpu_ms_per_heartbeat", "store_writes_s"))
                 for k in ("controller_idle", "controller_load")]
        print(f"| {r['engines']} | {r['startup_store_writes']} | {cells[0]} | {cells[1]} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
