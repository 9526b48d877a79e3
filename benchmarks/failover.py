"""Failure detection and recovery: kill a decode engine again and again under load.

Runs a Controller (memory store, or etcd with ``--store``), one NodeAgent with one
prefill and two decode engines (tiny model, TCP), and a closed-loop PD load that
routes by the Controller's view and retries a failed request on a fresh view until
its deadline (the Coordinator's behaviour). Each round SIGKILLs one decode engine
and measures, from the kill:

- detection: until the instance leaves the routable view;
- recovery: until it is READY in the view again (process relaunch + model load).

Prints p50/p99 of both and the client-visible error count (requests that never
succeeded). Rerun: ``.venv/bin/python -m benchmarks.failover --rounds 10``.
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

from tests.integration.test_control_plane_support import LoadDriver, ViewReader, roles
from tests.procs import PDSERVE, Proc


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--interval", type=float, default=0.2, help="heartbeat interval, seconds")
    ap.add_argument("--store", default="memory://")
    ap.add_argument("--concurrency", type=int, default=2)
    args = ap.parse_args()
    controller = Proc([*PDSERVE, "controller", "--store", args.store, "--host", "127.0.0.1",
                       "--port", "0", "--heartbeat-interval", str(args.interval),
                       "--suspect-after", "2", "--failed-after", "5", "--no-rebalance"])
    address = controller.wait_for(r"controller serving on (\S+)").group(1)
    agent = Proc([*PDSERVE, "nodeagent", "--controller", address, "--heartbeat-interval", str(args.interval),
                  "--instance", "p0=prefill", "--instance", "d0=decode", "--instance", "d1=decode",
                  "--restart-backoff", "0.1", "--restart-stable-after", "1",
                  "--engine-arg=--dtype=float32", "--engine-arg=--num-kv-blocks=512",
                  "--engine-arg=--threads=1", "--quiet-engines"])
    expected = {"p0": "prefill", "d0": "decode", "d1": "decode"}
    views = ViewReader([address])
    detect, recover = [], []
    try:
        views.wait(lambda v: roles(v) == expected, timeout_s=180)
        with LoadDriver(views, concurrency=args.concurrency) as load:
            views.wait(lambda v: load.num_ok >= 5, timeout_s=60)
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
                      f"recovered {recover[-1]:.1f} s", flush=True)
            num_ok = load.num_ok
            views.wait(lambda v: load.num_ok >= num_ok + 3, timeout_s=60)
        result = {
            "rounds": args.rounds, "heartbeat_interval_s": args.interval,
            "detect_ms_p50": round(statistics.median(detect) * 1000, 1),
            "detect_ms_p99": round(percentile(detect, 0.99) * 1000, 1),
            "recover_s_p50": round(statistics.median(recover), 2),
            "recover_s_p99": round(percentile(recover, 0.99), 2),
            "requests_ok": load.num_ok, "requests_retried": load.num_retries,
            "client_visible_errors": load.num_errors,
        }
        print(json.dumps(result, indent=2))
    finally:
        agent.stop()
        controller.stop()


if __name__ == "__main__":
    main()
