"""Failure detection and recovery: kill a decode engine again and again under client load.

Runs a Controller (memory store, or etcd with ``--store``), one NodeAgent with one
prefill and two decode engines (tiny model, TCP), a Coordinator watching the
Controller, and a closed-loop client load through the Coordinator's REST API
(streaming and non-streaming completions and chat completions; the client never
retries). Each round SIGKILLs one decode engine and measures, from the kill:

- detection: until the instance leaves the Controller's routable view;
- recovery: until it is READY in the view again (process relaunch + model load).

Prints p50/p99 of both, the client-visible errors (requests that did not succeed:
the aim is zero), the legs the Coordinator retried, and client latency.
Rerun: ``.venv/bin/python -m benchmarks.failover --rounds 6``.
The load driver and view reader are the control-plane tests' (tests/integration).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import time
import urllib.request

from tests.integration.test_control_plane_support import CoordinatorLoad, ViewReader, roles
from tests.procs import PDSERVE, Proc


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def coordinator_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name in ("retries_total", "continuations_total", "fallbacks_total"):
        values = re.findall(rf"^pdserve_coordinator_{name}(?:{{.*}})? (\S+)$", text, re.M)
        out[name] = sum(float(v) for v in values)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--interval", type=float, default=0.2, help="heartbeat interval, seconds")
    ap.add_argument("--store", default="memory://")
    ap.add_argument("--concurrency", type=int, default=4, help="clients, each one request at a time")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    procs: list[Proc] = []
    try:
        controller = Proc([*PDSERVE, "controller", "--store", args.store, "--host", "127.0.0.1",
                           "--port", "0", "--heartbeat-interval", str(args.interval),
                           "--suspect-after", "2", "--failed-after", "5", "--no-rebalance"])
        procs.append(controller)
        address = controller.wait_for(r"controller serving on (\S+)").group(1)
        agent = Proc([*PDSERVE, "nodeagent", "--controller", address, "--heartbeat-interval", str(args.interval),
                      "--instance", "p0=prefill", "--instance", "d0=decode", "--instance", "d1=decode",
                      "--restart-backoff", "0.1", "--restart-stable-after", "1",
                      "--engine-arg=--dtype=float32", "--engine-arg=--num-kv-blocks=512",
                      "--engine-arg=--threads=1", "--quiet-engines"])
        procs.append(agent)
        coordinator = Proc([*PDSERVE, "coordinator", "--controller", address, "--host", "127.0.0.1",
                            "--port", "0", "--log-level", "warning", "--request-timeout-s", "30"])
        procs.append(coordinator)
        url = "http://" + coordinator.wait_for(r"coordinator serving on (\S+)").group(1)
        expected = {"p0": "prefill", "d0": "decode", "d1": "decode"}
        views = ViewReader([address])
        detect, recover = [], []
        views.wait(lambda v: roles(v) == expected, timeout_s=180)
        with CoordinatorLoad(url, concurrency=args.concurrency, max_tokens=args.max_tokens) as load:
            load.wait_ok(10)
            started = time.monotonic()
            for n in range(args.rounds):
                victim = f"d{n % 2}"
                pid = int(re.findall(rf"{victim}: engine started \(pid (\d+)\)", agent.output)[-1])
                killed = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                views.wait(lambda v, victim=victim: victim not in roles(v), timeout_s=10, poll_s=0.005)
                detect.append(time.monotonic() - killed)
                views.wait(lambda v: roles(v) == expected, timeout_s=120, poll_s=0.02)
                recover.append(time.monotonic() - killed)
                print(f"round {n + 1}: {victim} detected {detect[-1] * 1000:.0f} ms, "
                      f"recovered {recover[-1]:.1f} s, {load.num_ok} ok, {load.num_errors} failed", flush=True)
            load.wait_ok(5)
            elapsed = time.monotonic() - started
        counters = coordinator_counters(url)
        result = {
            "rounds": args.rounds, "heartbeat_interval_s": args.interval, "concurrency": args.concurrency,
            "detect_ms_p50": round(statistics.median(detect) * 1000, 1),
            "detect_ms_p99": round(percentile(detect, 0.99) * 1000, 1),
            "recover_s_p50": round(statistics.median(recover), 2),
            "recover_s_p99": round(percentile(recover, 0.99), 2),
            "requests_ok": load.num_ok, "requests_ok_by_kind": dict(load.num_ok_by_kind),
            "client_visible_errors": load.num_errors,
            "legs_retried": counters["retries_total"], "streams_continued": counters["continuations_total"],
            "requests_in_fallback": counters["fallbacks_total"],
            "latency_s_p50": round(statistics.median(load.latencies_s), 3),
            "latency_s_p99": round(percentile(load.latencies_s, 0.99), 3),
            "requests_per_s": round(load.num_ok / elapsed, 1),
        }
        print(json.dumps(result, indent=2))
        for line in load.errors[:10]:
            print("error:", line)
    finally:
        for proc in reversed(procs):
            proc.stop()


if __name__ == "__main__":
    main()
