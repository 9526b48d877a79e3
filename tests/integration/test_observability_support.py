"""Support for the observability tests (no tests here): a local cluster as real processes,
each serving /metrics, a short disaggregated load through its Coordinator, and a real
Prometheus server scraping it.

The cluster is what ``pdserve up`` runs (Controller, one NodeAgent with a prefill and
a decode engine, Coordinator), started here so that each process's metrics port is
known: the NodeAgent passes ``--metrics-port 0`` to its engines and their addresses
are read from its output.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import httpx

from pdserve.runtime.kv_pool_master import READY_LINE as KV_POOL_READY
from tests.etcd import free_port
from tests.procs import PDSERVE, Proc
from tests.unit.coordinator.harness import ALWAYS_PD_ARGS

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
SCRAPE_INTERVAL_S = 1
INSTANCES = {"obs-p0": "prefill", "obs-d0": "decode"}


def http_get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - loopback only
        return r.read().decode()


def promtool_problems(text: str) -> str:
    """What ``promtool check metrics`` says about an exposition (empty: clean)."""
    out = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=30)
    return (out.stdout + out.stderr).strip() if out.returncode or out.stdout or out.stderr else ""


class LocalCluster:
    """Controller + NodeAgent (P and D engines) + Coordinator; ``targets`` maps each
    component to its metrics addresses, ``logs`` each process's output."""

    def __init__(self, env: dict | None = None, coordinator_args: tuple[str, ...] = ()) -> None:
        self.procs: list[Proc] = []
        try:
            self._start(env or {}, coordinator_args)
        except BaseException:
            self.stop()
            raise

    def _start(self, env: dict, coordinator_args: tuple[str, ...]) -> None:
        ctl = self._spawn(["controller", "--store", "memory://", "--host", "127.0.0.1",
                           "--port", "0", "--http-port", "0", "--heartbeat-interval", "0.5",
                           "--startup-grace", "60", "--no-rebalance",
                           "--planner", "advisory"], env)  # its metrics feed the dashboard's planner row
        m = ctl.wait_for(r"controller serving on (\S+:\d+) \(http (\S+:\d+)")
        self.controller, controller_http = m.group(1), m.group(2)
        # The engines share a KV pool, whose master Prometheus scrapes too.
        pool_port, pool_metrics = free_port(), free_port()
        pool = self._spawn(["kv-pool", "--port", str(pool_port),
                            "--metrics-port", str(pool_metrics)], env)
        pool.wait_for(KV_POOL_READY, 30)
        self.pool_targets = {"kv-pool": [f"127.0.0.1:{pool_metrics}"]}
        agent = self._spawn(["nodeagent", "--controller", self.controller, "--host", "127.0.0.1",
                             "--agent-id", "obs-agent", "--heartbeat-interval", "0.5",
                             "--engine-arg=--metrics-port=0",
                             f"--engine-arg=--kv-pool=127.0.0.1:{pool_port}",
                             "--engine-arg=--kv-pool-segment-mib=32",
                             *(f"--instance={i}={r}" for i, r in INSTANCES.items())], env)
        agent_http = agent.wait_for(r"http port (\d+)", 60).group(1)
        engines = {i: agent.wait_for(rf"\[{i}\] pdserve engine metrics on http://(\S+:\d+)/", 120)
                   .group(1) for i in INSTANCES}
        coord = self._spawn(["coordinator", "--controller", self.controller, "--port", "0",
                             "--coordinator-id", "obs-coordinator", *ALWAYS_PD_ARGS,
                             *coordinator_args], env)
        self.url = "http://" + coord.wait_for(r"coordinator serving on (\S+:\d+)", 60).group(1)
        self.controller_proc, self.agent_proc, self.coordinator_proc = ctl, agent, coord
        self.targets = {
            "controller": [controller_http], "nodeagent": [f"127.0.0.1:{agent_http}"],
            "coordinator": [self.url.removeprefix("http://")], "engine": list(engines.values()),
        }
        self.engine_targets = engines
        deadline = time.monotonic() + 120
        while httpx.get(self.url + "/ready").status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ready:\n{agent.output[-3000:]}")
            time.sleep(0.2)

    def _spawn(self, args: list[str], env: dict) -> Proc:
        proc = Proc([*PDSERVE, *args], env=env)
        self.procs.append(proc)
        return proc

    def complete(self, n: int, max_tokens: int = 8, stream: bool = False) -> list[str]:
        """``n`` completions through the Coordinator; returns their request ids."""
        ids = []
        with httpx.Client(base_url=self.url, timeout=60) as client:
            for k in range(n):
                body = {"model": "tiny", "prompt": f"request {k}: " + "tell me a story " * 4,
                        "max_tokens": max_tokens, "stream": stream}
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                ids.append(r.headers["x-request-id"])
        return ids

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        assert all(p.popen.poll() is not None for p in self.procs)


class Prometheus:
    """A real Prometheus server on a free loopback port scraping ``targets`` every second."""

    def __init__(self, workdir: Path, targets: dict[str, list[str]]) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        config = {"global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                             "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
                  "scrape_configs": [
                      {"job_name": f"pdserve-{component}",
                       "static_configs": [{"targets": addrs, "labels": {
                           "component": component, "namespace": "local", "cluster": "obs"}}]}
                      for component, addrs in targets.items()]}
        (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.workdir = workdir
        deadline = time.monotonic() + 30
        while True:
            try:
                if "Ready" in http_get(self.url + "/-/ready", 1):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise TimeoutError((workdir / "prometheus.log").read_text()[-3000:])
            time.sleep(0.2)

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            body = json.loads(http_get(url))
        except urllib.error.HTTPError as exc:  # Prometheus explains a bad query in the body
            raise AssertionError(f"{params}: {exc.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list:
        return self.api("query", query=expr)["result"]

    def wait_targets_up(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            active = self.api("targets")["activeTargets"]
            if active and all(t["health"] == "up" for t in active):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(json.dumps(active, indent=1))
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
