"""Chaos soak: steady streaming load through a whole cluster while random faults hit it.

The cluster (``chaos_support.SoakCluster``): real etcd, two Controller replicas, one
NodeAgent per engine (2 prefill, 2 decode; tiny model, one thread each, TCP KV
transport, layer-wise transfers, every request disaggregated) and a Coordinator.
The script:

1. Start it; wait until a leader serves the full PD view.
2. The no-fault run: each (endpoint, prompt) once, one at a time, greedy; then once
   more four at a time, which must give the same tokens (batching changes nothing).
3. Four streaming clients send requests back to back, for ``PDSERVE_SOAK_S`` seconds
   (default 60; longer runs set it), while one fault at a time hits the cluster, each 4-6 s after the
   previous one began: SIGKILL or SIGSTOP (2-5 s, then SIGCONT) of an engine, of a
   NodeAgent or of the leader Controller, or an etcd crash and restart. An engine or
   agent fault waits until both instances of its pool are READY (an engine restart
   takes ~20 s under this load), so a pool never loses both. A killed NodeAgent or
   Controller is started again after 0.5 s, as a kubelet would; engines are
   restarted by their agents.
4. Settle: the cluster whole again (every instance READY, PD mode), more requests ok.
5. Checks: no client-visible error (every request 200, streamed to the end, its tokens
   those of the no-fault run), every KV block of every engine free, nothing running
   or waiting in any engine or in the Coordinator, one Controller leading.
6. Stop everything; no process, listening port or shm segment is left.

The schedule is drawn from a seed, printed first; ``PDSERVE_SOAK_SEED=<seed>`` replays
it. Each fault is printed with its time, and the counts at the end (run with ``-s``).
"""

from __future__ import annotations

import functools
import os
import random
import time

from tests.integration.chaos_support import (
    KEYS,
    FaultLog,
    SoakCluster,
    StreamingLoad,
    build_schedule,
    inject,
    run_keys,
)

SEED = int(os.environ.get("PDSERVE_SOAK_SEED") or random.SystemRandom().randrange(1_000_000))
FAULT_PHASE_S = float(os.environ.get("PDSERVE_SOAK_S") or 60)
RECOVERY_LIMIT_S = 60.0   # a cluster that cannot take the next fault this long fails the soak


def test_chaos_soak(tmp_path):
    print(f"\nchaos soak: seed {SEED} (replay: PDSERVE_SOAK_SEED={SEED}), "
          f"{FAULT_PHASE_S:g}s of faults", flush=True)
    began = time.monotonic()
    cluster = SoakCluster(tmp_path / "etcd")
    try:
        cluster.start()
        cluster.wait_until(cluster.is_whole, 120)
        started_s = time.monotonic() - began

        no_fault = run_keys(cluster.url, KEYS)
        assert [e for _, e in no_fault.values() if e] == []
        expected = {key: ids for key, (ids, _) in no_fault.items()}
        batched = run_keys(cluster.url, KEYS, concurrency=4)
        assert {key: ids for key, (ids, _) in batched.items()} == expected, "batching changed the tokens"

        with StreamingLoad(cluster.url, expected, concurrency=4) as load:
            faults = FaultLog(load.started_s)
            load.wait_ok(len(KEYS))
            last_s = time.monotonic()
            for fault in build_schedule(SEED, 1000):
                time.sleep(max(0.0, last_s + fault.gap_s - time.monotonic()))
                can_take = functools.partial(cluster.can_take, fault)
                faults.waits_s.append(cluster.wait_until(can_take, RECOVERY_LIMIT_S))
                if time.monotonic() - load.started_s > FAULT_PHASE_S:
                    break
                last_s = time.monotonic()
                faults.add(last_s, fault, inject(cluster, fault))
            settle_s = cluster.wait_until(cluster.is_whole, 60)
            # more requests through the whole cluster (a liveness check, not a rate: a full
            # suite on a slow two-core host once served 27 of these 32 in 60 s, 0 failed)
            load.wait_ok(2 * len(KEYS), timeout_s=120)
        stats = cluster.kv_stats()
        coordinator = cluster.coordinator_metrics()
        num_leaders = cluster.num_leaders()
    finally:
        cluster.stop()
    leftovers = cluster.leftovers()

    counts = faults.counts()
    print(f"chaos soak, seed {SEED} (PDSERVE_SOAK_SEED={SEED} replays it), wall {time.monotonic() - began:.0f}s\n"
          f"  cluster up in {started_s:.1f}s, whole again {settle_s:.1f}s after the fault phase\n"
          f"  faults: {len(faults.entries)} {dict(sorted(counts.items()))}; "
          f"longest wait before one: {max(faults.waits_s, default=0):.1f}s\n"
          f"  requests: {load.num_requests}, ok {load.num_ok}, errors {load.num_errors} {dict(load.reasons)}; "
          f"slowest {max(load.latencies_s):.2f}s; legs retried by the Coordinator: "
          f"{coordinator['retries_total']:g}\n"
          f"  engine relaunches: {cluster.num_engine_launches - len(stats)}; leak check over "
          f"{len(cluster.every_proc)} processes, {len(cluster.engine_pids())} engines, "
          f"{len(cluster.ports | cluster.engine_ports())} ports", flush=True)

    assert load.errors == [], f"client-visible errors; faults:\n{faults}"
    assert num_leaders == 1
    for instance_id, s in stats.items():
        assert s.num_kv_blocks_free == s.num_kv_blocks_total, (instance_id, s)
        assert s.num_running == s.num_waiting == 0, (instance_id, s)
        assert s.num_kv_transfers_active == 0 and s.num_kv_blocks_quarantined == 0, (instance_id, s)
    assert coordinator["inflight_requests"] == coordinator["queued_requests"] == 0, coordinator
    assert coordinator["route_waiting_requests"] == 0, coordinator
    assert leftovers == []
