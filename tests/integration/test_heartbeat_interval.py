"""A Controller of more agents than ``--max-heartbeats-per-second`` allows tells them a
longer interval, and the real NodeAgent follows it while the Controller judges its
instance by it: real processes (``pdserve controller`` and ``pdserve nodeagent`` with a
simulated engine), with the rate set so one agent is already past it."""

from __future__ import annotations

import re
import time

import grpc
import httpx

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from tests.integration.test_up_spec import write_yaml
from tests.procs import PDSERVE, Proc

INTERVAL_S = 0.25  # configured; one agent at 0.5 a second at most: told 2 s


def heartbeats(http: str) -> float:
    text = httpx.get(f"http://{http}/metrics", timeout=5).text
    return float(re.search(r"^pdserve_controller_heartbeats_total (\S+)$", text, re.M).group(1))


def routable(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        view = pb_grpc.ControllerStub(channel).GetView(pb.WatchViewRequest(), timeout=5)
    return [i.instance_id for i in view.instances]


def test_agents_past_the_rate_heartbeat_at_the_longer_interval_and_stay_ready(tmp_path):
    spec = write_yaml(tmp_path / "cluster.yaml", {
        "model": {"preset": "small"}, "engine": {"kvCacheBytes": "16Mi", "simulate": {}},
        "prefill": {"replicas": 0}, "decode": {"replicas": 1, "threads": 1}}, name="hb")
    controller = Proc([*PDSERVE, "controller", "-f", str(spec), "--store", "memory://", "--host", "127.0.0.1",
                       "--port", "0", "--heartbeat-interval", str(INTERVAL_S), "--suspect-after", "2",
                       "--max-heartbeats-per-second", "0.5"])
    procs = [controller]
    try:
        m = controller.wait_for(r"controller serving on (\S+) \(http (\S+),", timeout_s=30)
        address, http = m.group(1), m.group(2)
        procs.append(Proc([*PDSERVE, "nodeagent", "--controller", address, "-f", str(spec),
                           "--instance", "hb-decode-0=decode", "--heartbeat-interval", str(INTERVAL_S),
                           "--quiet-engines"]))
        deadline = time.monotonic() + 90
        while routable(address) != ["hb-decode-0"]:
            assert time.monotonic() < deadline, "the engine never became routable"
            time.sleep(0.2)
        time.sleep(2.5)  # past the first reply telling the longer interval
        before, began = heartbeats(http), time.monotonic()
        views = []
        while time.monotonic() - began < 8.0:
            views.append(routable(address))
            time.sleep(0.2)
        rate = (heartbeats(http) - before) / (time.monotonic() - began)
    finally:
        for proc in reversed(procs):
            proc.stop()
    # every 2 s (the configured 0.25 s would be 4 a second), and never judged silent by 0.25 s
    assert 0.25 <= rate <= 1.0, rate
    assert all(v == ["hb-decode-0"] for v in views), views
