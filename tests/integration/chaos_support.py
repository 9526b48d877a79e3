"""Support for the chaos soak (no tests here): the cluster, its load, the faults.

``SoakCluster`` runs a whole control plane as real loopback processes: etcd, two
Controller replicas on fixed ports (one that died comes back on the same address, as
a Deployment's Pod does behind its Service), one NodeAgent per engine (``p0``, ``p1``
prefill, ``d0``, ``d1`` decode; one Pod each on Kubernetes) and a Coordinator that
watches both Controllers. The test stands in for the kubelet and the Deployment: a
NodeAgent or Controller it killed, it starts again; engines are restarted by their
agents, as in production. Every process, pid and port it ever started is kept, for
the leak check at the end (``leftovers``).

``StreamingLoad``: closed-loop streaming clients in a background thread, each
sending one request after the other from a fixed set of (endpoint, prompt) keys,
greedy, ``ignore_eos``, fixed ``max_tokens``, with the token ids streamed back. A
request is ok when it answered 200, every chunk parsed, no error event came, it ended
with ``finish_reason`` "length" and ``data: [DONE]``, and its token ids equal the
no-fault run's (``expected``); anything else is a client-visible error. Clients never
retry: that is the Coordinator's job.

``build_schedule``: the faults, drawn from one seed, so a seed replays the same
sequence (kinds, targets, pauses, gaps; the times depend on the machine).
``inject`` carries one out. Faults run one at a time: each starts its gap after the
previous one started, once that one ended and the cluster can take it
(``SoakCluster.can_take``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import glob
import json
import os
import random
import re
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.runtime.engine_client import EngineClient
from tests.etcd import EtcdServer, free_port
from tests.integration.test_control_plane_support import CoordinatorLoad, ViewReader, roles
from tests.procs import PDSERVE, Proc
from tests.unit.coordinator.harness import ALWAYS_PD_ARGS

INSTANCES = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
INTERVAL_S = 0.2              # heartbeats and probes
LEADER_TTL_S = 2
REQUEST_TIMEOUT_S = 30.0      # the Coordinator's one deadline per request
MAX_TOKENS = 24
RESPAWN_DELAY_S = 0.5         # the kubelet's (the Deployment's) restart delay, stood in for
ENGINE_FLAGS = ["--dtype=float32", "--num-kv-blocks=256", "--threads=1", "--kv-transport=tcp"]
SHM_GLOB = "/dev/shm/pdserve-kv-{pid}-*"   # the shm transport's segments (pdserve/nodeagent/process.py)

# Prompts of several lengths; 4-7 share a long prefix (prefix-cache hits on P and on D).
_SHARED = "The harbour master counted every ship that came in before dawn, and "
PROMPTS = ["Hi.", "Count the colours of the sea, one by one.",
           "Name three rivers and the seas they flow into, in order of length. " * 2,
           "A long prompt about mountains, valleys and the weather between them. " * 4,
           *(_SHARED * 3 + tail for tail in ("then slept.", "then wrote it down.",
                                             "then told nobody.", "then did it again."))]
ENDPOINTS = ("completions", "chat/completions")
KEYS = [(endpoint, i) for i in range(len(PROMPTS)) for endpoint in ENDPOINTS]


def request_body(key: tuple[str, int]) -> dict:
    endpoint, i = key
    body: dict = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
                  "ignore_eos": True, "return_token_ids": True}
    if endpoint == "chat/completions":
        body["messages"] = [{"role": "user", "content": PROMPTS[i]}]
    else:
        body["prompt"] = PROMPTS[i]
    return body


async def stream_tokens(client: httpx.AsyncClient, key: tuple[str, int]) -> tuple[list[int], str | None]:
    """One streamed request: (token ids streamed, None) or (what arrived, the error)."""
    ids: list[int] = []
    finish_reason, is_done = None, False
    async with client.stream("POST", f"/v1/{key[0]}", json=request_body(key)) as r:
        if r.status_code != 200:
            return ids, f"HTTP {r.status_code} {(await r.aread()).decode()[:300]}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                is_done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return ids, f"error event {line[6:300]}"
            for choice in event["choices"]:
                ids += choice.get("token_ids") or []
                finish_reason = choice["finish_reason"] or finish_reason
    if not is_done:
        return ids, "stream ended without [DONE]"
    if finish_reason != "length":
        return ids, f"finish_reason {finish_reason!r}"
    return ids, None


async def _run_keys(base_url: str, keys: list[tuple[str, int]], concurrency: int) -> dict:
    """Each key once, ``concurrency`` at a time: {key: (token ids, error)}."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S + 30) as client:
        async def one(key):
            async with gate:
                return key, await stream_tokens(client, key)
        return dict(await asyncio.gather(*map(one, keys)))


def run_keys(base_url: str, keys: list[tuple[str, int]], concurrency: int = 1) -> dict:
    return asyncio.run(_run_keys(base_url, keys, concurrency))


class StreamingLoad(CoordinatorLoad):
    """``concurrency`` streaming clients through the Coordinator, in a background thread,
    checked against ``expected`` (key -> token ids). Started by ``with`` (the harness
    is ``CoordinatorLoad``'s, the requests are these); ``errors`` holds one line per
    failed request: when it started (seconds since the load began), which, what went
    wrong; ``reasons`` counts them by kind."""

    def __init__(self, base_url: str, expected: dict, concurrency: int = 4) -> None:
        super().__init__(base_url, concurrency, MAX_TOKENS, timeout_s=REQUEST_TIMEOUT_S + 30)
        self.expected = expected
        self.reasons: collections.Counter[str] = collections.Counter()
        self.started_s = time.monotonic()

    @property
    def num_requests(self) -> int:
        return self.num_ok + self.num_errors

    def __enter__(self) -> StreamingLoad:
        self.started_s = time.monotonic()
        return super().__enter__()

    async def _client(self, client: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            n = next(self._ids)
            key = KEYS[n % len(KEYS)]
            started = time.monotonic()
            try:
                ids, error = await stream_tokens(client, key)
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
                ids, error = [], f"{type(exc).__name__}: {exc}"
            if error is None and ids != self.expected[key]:
                error = f"output differs from the no-fault run: {ids} != {self.expected[key]}"
            if error is None:
                self.num_ok += 1
                self.latencies_s.append(time.monotonic() - started)
                continue
            self.reasons[error.split(" ")[0]] += 1
            line = (f"[soak +{started - self.started_s:6.1f}s] request {n} {key} failed "
                    f"after {time.monotonic() - started:.1f}s: {error[:300]}")
            self.errors.append(line)
            print(line, flush=True)


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie does not count: it holds no port, no memory)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _is_pdserve(pid: int) -> bool:
    """``pid`` is still one of ours (a pdserve process), not a reused pid."""
    try:
        return b"pdserve" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _signal(pid: int, sig: int) -> None:
    """``sig`` to ``pid`` alone (not its group), if it is still a pdserve process."""
    if _is_pdserve(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _is_listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


CONTROLLER_FLAGS = ["--heartbeat-interval", str(INTERVAL_S), "--suspect-after", "2",
                    "--failed-after", "5", "--hysteresis", "1", "--leader-ttl", str(LEADER_TTL_S),
                    "--lease-ttl", "10", "--no-rebalance", "--host", "127.0.0.1"]


class SoakCluster:
    """The processes of one soak. Built and torn down by the test, from its thread only."""

    def __init__(self, data_dir: Path) -> None:
        self.etcd = EtcdServer(data_dir)
        self.controller_ports = [(free_port(), free_port()) for _ in range(2)]  # (gRPC, HTTP)
        self.controller_addresses = [f"127.0.0.1:{grpc_port}" for grpc_port, _ in self.controller_ports]
        self.controllers: list[Proc | None] = [None, None]
        self.agents: dict[str, Proc] = {}
        self.coordinator: Proc | None = None
        self.url = ""
        self.views = ViewReader(self.controller_addresses)
        self.every_proc: list[Proc] = []   # every process started, restarts included
        self.ports: set[int] = {self.etcd.client_port, self.etcd.peer_port}

    # --- start, restart ---------------------------------------------------------
    def start(self) -> SoakCluster:
        """Every process launched at once, then each waited for (Python starts slowly)."""
        self.etcd.start()
        for i in range(2):
            self.start_controller(i, wait=False)
        for instance_id in INSTANCES:
            self.start_agent(instance_id, wait=False)
        self.coordinator = self._spawn([
            *PDSERVE, "coordinator", "--controller", ",".join(self.controller_addresses),
            "--host", "127.0.0.1", "--port", "0", "--log-level", "warning",
            "--request-timeout-s", str(REQUEST_TIMEOUT_S), *ALWAYS_PD_ARGS])
        for proc in self.controllers:
            proc.wait_for(r"controller serving on", timeout_s=90)
        for proc in self.agents.values():
            self._await_agent(proc)
        address = self.coordinator.wait_for(r"coordinator serving on (\S+)", timeout_s=90).group(1)
        self.ports.add(int(address.rsplit(":", 1)[1]))
        self.url = f"http://{address}"
        return self

    def _spawn(self, args: list[str]) -> Proc:
        proc = Proc(args)
        self.every_proc.append(proc)
        return proc

    def start_controller(self, index: int, wait: bool = True) -> None:
        """Replica ``index`` on its own ports (again, after a kill)."""
        grpc_port, http_port = self.controller_ports[index]
        self.ports |= {grpc_port, http_port}
        self.controllers[index] = self._spawn([
            *PDSERVE, "controller", "--store", self.etcd.url, *CONTROLLER_FLAGS,
            "--port", str(grpc_port), "--http-port", str(http_port)])
        if wait:
            self.controllers[index].wait_for(r"controller serving on", timeout_s=60)

    def start_agent(self, instance_id: str, wait: bool = True) -> None:
        """The NodeAgent of ``instance_id`` (again, after a kill), as its Pod's container."""
        self.agents[instance_id] = self._spawn([
            *PDSERVE, "nodeagent", "--controller", ",".join(self.controller_addresses),
            "--instance", f"{instance_id}={INSTANCES[instance_id]}", "--agent-id", f"agent-{instance_id}",
            "--heartbeat-interval", str(INTERVAL_S), "--restart-backoff", "0.1",
            "--restart-backoff-max", "2", *(f"--engine-arg={flag}" for flag in ENGINE_FLAGS)])
        if wait:
            self._await_agent(self.agents[instance_id])

    def _await_agent(self, proc: Proc) -> None:
        self.ports.add(int(proc.wait_for(r"http port (\d+)", timeout_s=90).group(1)))

    def leader_index(self) -> int | None:
        view = self.views.get()
        if view is None or not view.leader:
            return None
        return self.controller_addresses.index(view.leader) if view.leader in self.controller_addresses else None

    def engine_pid(self, instance_id: str) -> int:
        """The pid of the engine ``instance_id``'s agent launched last."""
        pids = re.findall(rf"{instance_id}: engine started \(pid (\d+)\)", self.agents[instance_id].output)
        return int(pids[-1])

    def engine_pids(self) -> list[int]:
        """Every engine pid any agent of this soak launched."""
        return [int(pid) for proc in self.every_proc
                for pid in re.findall(r": engine started \(pid (\d+)\)", proc.output)]

    @property
    def num_engine_launches(self) -> int:
        return len(self.engine_pids())

    # --- state ------------------------------------------------------------------
    def _view(self):
        """The leader's view while every process of the cluster runs, else None."""
        procs = [*self.controllers, *self.agents.values(), self.coordinator]
        if any(p is None or p.popen.poll() is not None for p in procs):
            return None
        view = self.views.get()
        if view is None or not view.leader:
            return None
        for i in view.instances:  # for the leak check
            self.ports |= {int(a.rsplit(":", 1)[1]) for a in (i.engine_address, i.kv_endpoint) if a}
        return view

    def is_whole(self) -> bool:
        """Every process runs, a leader serves the full PD view (every instance READY)."""
        view = self._view()
        return view is not None and view.mode == "PD" and roles(view) == INSTANCES

    def can_take(self, fault: Fault) -> bool:
        """The cluster can lose what ``fault`` hits and go on serving: every process runs,
        a leader serves PD, and for an engine or agent fault its instance and the other
        one of its pool are READY (one fault at a time per pool; an engine may still be
        restarting elsewhere)."""
        view = self._view()
        if view is None or view.mode != "PD":
            return False
        if fault.kind in ("kill leader", "stop leader", "restart etcd"):
            return True
        pool = INSTANCES[fault.instance_id]
        return all(roles(view).get(i) == pool for i, role in INSTANCES.items() if role == pool)

    def wait_until(self, predicate, timeout_s: float) -> float:
        """Seconds until ``predicate()``; TimeoutError past ``timeout_s``."""
        started = time.monotonic()
        while not predicate():
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"the cluster did not recover in {timeout_s:g}s; "
                                   f"last view:\n{self.views.get()}")
            time.sleep(0.1)
        return time.monotonic() - started

    def num_leaders(self) -> int:
        """Replicas that answer GetView: the leader only (a standby refuses)."""
        return sum(ViewReader([address]).get() is not None for address in self.controller_addresses)

    def engine_addresses(self) -> dict[str, str]:
        return {i.instance_id: i.engine_address for i in self.views.get().instances}

    def kv_stats(self) -> dict:
        """Each engine's Stats once its work is done (or after 15 s): {instance id: stats}."""
        async def settled(address: str):
            async with EngineClient(address) as client:
                deadline = time.monotonic() + 15
                while True:
                    s = await client.stats()
                    if (s.num_kv_blocks_free == s.num_kv_blocks_total and s.num_running == 0
                            and s.num_waiting == 0 and s.num_kv_transfers_active == 0
                            and s.num_kv_blocks_quarantined == 0) or time.monotonic() > deadline:
                        return s
                    await asyncio.sleep(0.1)

        async def every():
            addresses = self.engine_addresses()
            stats = await asyncio.gather(*map(settled, addresses.values()))
            return dict(zip(addresses, stats, strict=True))

        return asyncio.run(every())

    def coordinator_metrics(self) -> dict[str, float]:
        """The Coordinator's metrics this soak reads: legs retried (summed over labels),
        requests in flight, waiting for admission, waiting for an engine pool."""
        text = httpx.get(self.url + "/metrics", timeout=5).text

        def total(name: str) -> float:
            return sum(float(v) for v in re.findall(rf"^pdserve_coordinator_{name}(?:{{.*}})? (\S+)$", text, re.M))

        return {name: total(name) for name in
                ("retries_total", "inflight_requests", "queued_requests", "route_waiting_requests")}

    # --- stop, leftovers --------------------------------------------------------
    def stop(self) -> None:
        """Everything stopped (SIGCONT first: a stopped process cannot end), engines by
        their agents, the Coordinator first and etcd last."""
        for proc in self.every_proc:
            if proc.popen.poll() is None:
                _signal(proc.popen.pid, signal.SIGCONT)
        for pid in self.engine_pids():
            _signal(pid, signal.SIGCONT)
        for proc in [self.coordinator, *self.agents.values(), *self.controllers]:
            if proc is not None:
                proc.stop()
        for proc in self.every_proc:
            proc.stop()
        self.etcd.stop()

    def engine_ports(self) -> set[int]:
        """Every port an engine printed (gRPC, metrics); KV ports come from the views."""
        return {int(port) for proc in self.every_proc
                for port in re.findall(r"\] pdserve engine (?:serving model .* on|metrics on http://)"
                                       r"127\.0\.0\.1:(\d+)", proc.output)}

    def leftovers(self) -> list[str]:
        """What outlived ``stop``: processes, listening ports, shm segments."""
        found = [f"process {p.popen.pid} ({' '.join(p.args[3:5])}) still runs"
                 for p in self.every_proc if p.popen.poll() is None]
        if self.etcd.proc is not None:
            found.append("etcd still runs")
        found += [f"engine process {pid} still runs" for pid in self.engine_pids()
                  if _alive(pid) and _is_pdserve(pid)]
        found += [f"port {port} still listens" for port in sorted(self.ports | self.engine_ports())
                  if _is_listening(port)]
        found += [f"shm segment {path} left" for pid in self.engine_pids()
                  for path in glob.glob(SHM_GLOB.format(pid=pid))]
        return found


# --- faults ---------------------------------------------------------------------
KINDS = ("kill engine", "stop engine", "kill agent", "stop agent",
         "kill leader", "stop leader", "restart etcd")


@dataclass(frozen=True)
class Fault:
    kind: str
    instance_id: str      # the engine or agent it hits (engine and agent faults)
    pause_s: float        # how long a SIGSTOP lasts, or etcd is down
    gap_s: float          # from the previous fault's start to its own (or later: ``can_take``)


def build_schedule(seed: int, num: int) -> list[Fault]:
    """``num`` faults drawn from ``seed``: kinds uniform, pauses 2-5 s (etcd down 0.5-3 s),
    gaps 4-6 s."""
    rng = random.Random(seed)
    faults = []
    for _ in range(num):
        kind = rng.choice(KINDS)
        pause_s = rng.uniform(0.5, 3.0) if kind == "restart etcd" else rng.uniform(2.0, 5.0)
        faults.append(Fault(kind, rng.choice(sorted(INSTANCES)), round(pause_s, 2), round(rng.uniform(4, 6), 2)))
    return faults


def inject(cluster: SoakCluster, fault: Fault) -> str:
    """Carry ``fault`` out (blocking for its pause, and for the respawn of what it
    killed); returns what it did, for the log. Signals go to one pid, never a group:
    an agent's engines are in its process group and must live or die on their own."""
    kind, iid = fault.kind, fault.instance_id
    if kind.endswith("engine"):
        pid, what = cluster.engine_pid(iid), f"engine {iid}"
    elif kind.endswith("agent"):
        pid, what = cluster.agents[iid].popen.pid, f"agent of {iid}"
    elif kind.endswith("leader"):
        index = cluster.leader_index()
        if index is None:
            return "no leader to hit (skipped)"
        pid, what = cluster.controllers[index].popen.pid, f"leader controller {index}"
    else:
        cluster.etcd.kill()
        time.sleep(fault.pause_s)
        cluster.etcd.start()
        return f"SIGKILL etcd, restarted after {fault.pause_s:g}s"
    if kind.startswith("stop"):
        _signal(pid, signal.SIGSTOP)
        time.sleep(fault.pause_s)
        _signal(pid, signal.SIGCONT)
        return f"SIGSTOP {what} (pid {pid}) for {fault.pause_s:g}s"
    _signal(pid, signal.SIGKILL)
    if kind == "kill agent":
        cluster.agents[iid].popen.wait(10)
        time.sleep(RESPAWN_DELAY_S)
        cluster.start_agent(iid)
    elif kind == "kill leader":
        cluster.controllers[index].popen.wait(10)
        time.sleep(RESPAWN_DELAY_S)
        cluster.start_controller(index)
    return f"SIGKILL {what} (pid {pid})"


class FaultLog:
    """The faults carried out, each at its time since ``started_s`` (the load's start,
    so fault and error times line up); printed as it goes."""

    def __init__(self, started_s: float) -> None:
        self.started_s = started_s
        self.entries: list[tuple[float, Fault, str]] = []
        self.waits_s: list[float] = []   # per fault: the wait, after its gap, until the cluster could take it

    def add(self, started_s: float, fault: Fault, what: str) -> None:
        at_s = started_s - self.started_s
        self.entries.append((at_s, fault, what))
        print(f"[soak +{at_s:6.1f}s] fault {len(self.entries)}: {what}", flush=True)

    def __str__(self) -> str:
        return "\n".join(f"+{at_s:6.1f}s {what}" for at_s, _, what in self.entries)

    def counts(self) -> collections.Counter[str]:
        return collections.Counter(f.kind for _, f, what in self.entries if "skipped" not in what)
