"""The control plane with real processes: etcd, two Controller replicas, a NodeAgent
supervising one prefill and one decode engine (tiny model, TCP KV transport), and a
Coordinator that watches both Controller replicas (``--controller A,B``).

One cluster for the whole module, scenarios in order: a decode engine killed under
client load through the Coordinator (zero failed requests), every prefill killed
(FALLBACK and back), the leader Controller killed under load, etcd restarted.
Heartbeats every 0.2 s keep it short.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
import urllib.request

import httpx
import pytest

from pdserve.controller.store import open_store
from tests.etcd import EtcdServer
from tests.integration.test_control_plane_support import CoordinatorLoad, ViewReader, roles
from tests.procs import PDSERVE, Proc
from tests.unit.coordinator.harness import ALWAYS_PD_ARGS

INTERVAL_S = 0.2
CONTROLLER_FLAGS = ["--heartbeat-interval", str(INTERVAL_S), "--suspect-after", "2",
                    "--failed-after", "5", "--hysteresis", "1", "--leader-ttl", "2",
                    "--lease-ttl", "10", "--no-rebalance", "--host", "127.0.0.1", "--port", "0"]


def start_controller(etcd: EtcdServer) -> tuple[Proc, str, str]:
    proc = Proc([*PDSERVE, "controller", "--store", etcd.url, *CONTROLLER_FLAGS])
    m = proc.wait_for(r"controller serving on (\S+) \(http (\S+),", timeout_s=30)
    return proc, m.group(1), m.group(2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    etcd = EtcdServer(tmp_path_factory.mktemp("etcd") / "data").start()
    procs: list[Proc] = []
    try:
        controllers = [start_controller(etcd) for _ in range(2)]
        procs += [c[0] for c in controllers]
        agent = Proc([*PDSERVE, "nodeagent", "--controller", ",".join(c[1] for c in controllers),
                      "--instance", "p0=prefill", "--instance", "d0=decode",
                      "--heartbeat-interval", str(INTERVAL_S), "--restart-backoff", "0.1",
                      "--engine-arg=--dtype=float32", "--engine-arg=--num-kv-blocks=512",
                      "--engine-arg=--threads=1"])
        procs.append(agent)
        coordinator = Proc([*PDSERVE, "coordinator", "--controller", ",".join(c[1] for c in controllers),
                            "--host", "127.0.0.1", "--port", "0", "--log-level", "warning",
                            "--request-timeout-s", "30", *ALWAYS_PD_ARGS])
        procs.append(coordinator)
        url = "http://" + coordinator.wait_for(r"coordinator serving on (\S+)", timeout_s=60).group(1)
        views = ViewReader([c[1] for c in controllers])
        views.wait(lambda v: roles(v) == {"p0": "prefill", "d0": "decode"}, timeout_s=120)
        yield {"etcd": etcd, "controllers": controllers, "agent": agent, "views": views,
               "coordinator": coordinator, "url": url}
    finally:
        for proc in procs:
            proc.stop()
        etcd.stop()
    for proc in procs:
        assert proc.popen.poll() is not None  # every process reaped


def engine_pid(agent: Proc, instance_id: str) -> int:
    pids = re.findall(rf"{instance_id}: engine started \(pid (\d+)\)", agent.output)
    return int(pids[-1])


def metric(http_address: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{http_address}/metrics", timeout=2) as r:
        m = re.search(rf"^{name} (\S+)$", r.read().decode(), re.M)
    return float(m.group(1))


def kill_engine(cluster, instance_id: str) -> float:
    import os

    os.kill(engine_pid(cluster["agent"], instance_id), signal.SIGKILL)
    return time.monotonic()


def coordinator_state(cluster) -> dict:
    return httpx.get(cluster["url"] + "/ui/state", timeout=5).json()


def coordinator_retries(cluster) -> float:
    text = httpx.get(cluster["url"] + "/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(r"^pdserve_coordinator_retries_total\{.*\} (\S+)$", text, re.M))


def test_killed_decode_is_detected_routed_around_and_restarted_with_no_failed_request(cluster):
    views = cluster["views"]
    with CoordinatorLoad(cluster["url"], concurrency=4) as load:
        load.wait_ok(8)
        killed_at = kill_engine(cluster, "d0")
        views.wait(lambda v: "d0" not in roles(v), timeout_s=5, poll_s=0.005)
        detected_s = time.monotonic() - killed_at
        views.wait(lambda v: v.mode == "PD" and roles(v) == {"p0": "prefill", "d0": "decode"},
                   timeout_s=60)
        recovered_s = time.monotonic() - killed_at
        num_ok_at_recovery = load.num_ok
        load.wait_ok(8)  # PD again, through the relaunched d0
    print(f"detected in {detected_s:.3f}s, recovered in {recovered_s:.1f}s, {load.num_ok} ok "
          f"({dict(load.num_ok_by_kind)}), {num_ok_at_recovery} before recovery, {load.num_errors} failed, "
          f"{coordinator_retries(cluster):g} legs retried by the Coordinator")
    # The agent reports the exit with its next heartbeat (0.07 s alone); the bound is five
    # intervals, as a full suite on two cores once took 0.42 s.
    assert detected_s <= 5 * INTERVAL_S
    assert load.errors == []
    assert set(load.num_ok_by_kind) == {"completions", "completions stream", "chat/completions",
                                       "chat/completions stream"}


def test_no_prefill_enters_fallback_and_pd_is_restored(cluster):
    views = cluster["views"]
    leader_http = next(c[2] for c in cluster["controllers"] if c[1] == views.get().leader)
    kill_engine(cluster, "p0")
    view = views.wait(lambda v: v.mode == "FALLBACK", timeout_s=5)
    assert "prefill" in view.fallback_reason
    views.wait(lambda v: roles(v).get("d0") == "hybrid", timeout_s=10)  # drain + SetRole
    assert metric(leader_http, "pdserve_controller_fallback_mode") == 1.0
    views.wait(lambda v: v.mode == "PD" and roles(v) == {"p0": "prefill", "d0": "decode"},
               timeout_s=60)
    assert metric(leader_http, "pdserve_controller_fallback_mode") == 0.0
    assert metric(leader_http, "pdserve_controller_role_switches_total") >= 2


def test_killed_leader_hands_over_with_the_view_intact(cluster):
    views = cluster["views"]
    before = views.get()
    leader = next(c for c in cluster["controllers"] if c[1] == before.leader)
    with CoordinatorLoad(cluster["url"], concurrency=2) as load:
        load.wait_ok(2)
        leader[0].signal(signal.SIGKILL)
        killed_at = time.monotonic()
        after = views.wait(lambda v: v.leader and v.leader != before.leader, timeout_s=10, poll_s=0.05)
        handover_s = time.monotonic() - killed_at
        print(f"standby leads after {handover_s:.2f}s")
        assert handover_s < 5
        events = "\n".join(after.recent_events)
        assert roles(after) == {"p0": "prefill", "d0": "decode"} and after.mode == "PD", events
        # the agent follows the new leader: heartbeats keep the instances READY, untouched
        time.sleep(10 * INTERVAL_S)
        view = views.get()
        assert roles(view) == {"p0": "prefill", "d0": "decode"} and view.mode == "PD", view.recent_events
        assert not any("switch role" in e or "->" in e for e in view.recent_events), view.recent_events
        # the Coordinator follows too: views keep arriving, now from the new leader
        version = coordinator_state(cluster)["view_version"]
        deadline = time.monotonic() + 5
        while coordinator_state(cluster)["view_version"] < version + 2:
            assert time.monotonic() < deadline, "the Coordinator gets no views from the new leader"
            time.sleep(0.1)
        load.wait_ok(4)
    assert load.errors == []


def test_etcd_restart_recovers_without_manual_steps(cluster):
    views, etcd = cluster["views"], cluster["etcd"]
    leader_http = next(c[2] for c in cluster["controllers"] if c[1] == views.get().leader)
    etcd.restart()
    kill_engine(cluster, "d0")  # the cluster keeps working through the restart
    views.wait(lambda v: "d0" not in roles(v), timeout_s=5)
    views.wait(lambda v: v.mode == "PD" and roles(v) == {"p0": "prefill", "d0": "decode"},
               timeout_s=60)
    deadline = time.monotonic() + 10
    while metric(leader_http, "pdserve_controller_store_ok") != 1.0:
        assert time.monotonic() < deadline, "store never came back"
        time.sleep(0.2)

    async def stored() -> dict:
        store = open_store(etcd.url)
        try:
            return await store.get_prefix("/pdserve/local/instances/")
        finally:
            await store.close()

    deadline = time.monotonic() + 10
    while set(asyncio.run(stored())) != {"/pdserve/local/instances/p0", "/pdserve/local/instances/d0"}:
        assert time.monotonic() < deadline
        time.sleep(0.2)
