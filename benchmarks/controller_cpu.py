"""The leading Controller's own work per cluster size, in one process, no I/O: what one
heartbeat carrying every engine's report costs (``pdserve up``: one NodeAgent
supervises all of them), what N one-report heartbeats cost (Kubernetes: an agent per
engine), one ``tick`` (silence, mode, rebalance) and one view (built on every commit and
pushed to every Coordinator). Best of ``--repeat`` timings of each, in milliseconds.

The loads change from one heartbeat to the next (as they do under traffic), nothing
else does: the steady state of a serving cluster.

Rerun, against a baseline revision, alternated:
    benchmarks/ab_revisions.sh BASE HEAD 3 -- benchmarks/controller_cpu.py --engines 100,1000
"""

from __future__ import annotations

import argparse
import time

from pdserve.api.proto import controller_pb2 as pb
from pdserve.controller.cluster import Cluster, ClusterSettings


def heartbeat(n: int, step: int, num_prefill: int) -> pb.HeartbeatRequest:
    req = pb.HeartbeatRequest(agent_id="agent")
    for i in range(n):
        role = "prefill" if i < num_prefill else "decode"
        r = req.instances.add(
            instance_id=f"e{i}", role=role, pool=role, process_state="running", probe_ok=True,
            engine_address=f"127.0.0.1:{10000 + i}", kv_endpoint=f"127.0.0.1:{30000 + i}",
            kv_transport="tcp", kv_compat_hash="h", model="m", max_model_len=2048,
            peers_checked_version=1, checks_peers=True)
        r.load.num_running, r.load.num_kv_blocks_free = (i + step) % 4, 1000 - step
        r.load.num_generation_tokens_total, r.load.decode_step_s_total = 100 * step, 0.5 * step
    return req


def best_ms(fn, repeat: int) -> float:
    times = []
    for k in range(repeat):
        started = time.perf_counter()
        fn(k)
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def measure(n: int, repeat: int) -> dict[str, float]:
    beats = [heartbeat(n, step, max(1, n // 250)) for step in range(4)]
    c = Cluster(ClusterSettings(), now_s=0.0)
    c.apply_heartbeat("agent", beats[0].instances, 0.0)
    now = [0.0]  # each timed call one step later; every engine heard within the step

    def at_next() -> float:
        now[0] += 0.1
        return now[0]

    one = best_ms(lambda k: c.apply_heartbeat("agent", beats[k % 4].instances, at_next()), repeat)
    singles = [[pb.HeartbeatRequest(agent_id="agent", instances=[r]) for r in b.instances] for b in beats]
    per_agent = best_ms(lambda k: [c.apply_heartbeat("agent", s.instances, t)
                                   for t in [at_next()] for s in singles[k % 4]], repeat)
    tick = best_ms(lambda k: c.tick(now[0]), repeat)
    view = best_ms(lambda k: c.view("me"), repeat)
    assert len(c.view("me").instances) == n
    return {"one_heartbeat_ms": one, "n_heartbeats_ms": per_agent, "tick_ms": tick, "view_ms": view}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="100,1000", help="cluster sizes, comma-separated")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    print(f"{'engines':>8} {'1 heartbeat of N ms':>20} {'N heartbeats of 1 ms':>21} {'tick ms':>8} {'view ms':>8}")
    for n in (int(x) for x in args.engines.split(",")):
        m = measure(n, args.repeat)
        print(f"{n:>8} {m['one_heartbeat_ms']:>20.2f} {m['n_heartbeats_ms']:>21.2f} "
              f"{m['tick_ms']:>8.2f} {m['view_ms']:>8.2f}")


if __name__ == "__main__":
    main()
