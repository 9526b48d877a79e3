"""``pdserve up``: run a PDCluster on this machine as processes and stop them all on Ctrl-C.

Starts the Controller (in-memory store), one NodeAgent with every instance of
the prefill, decode and hybrid pools (it launches the engines, pinned to each
pool's ``cpuAffinity`` cores) and, when this build has one, the Coordinator on
``--host``/``--port`` with the spec's settings (``component_args.coordinator_argv``,
the operator's mapping too). Shows progress from the Controller's view while models
load, prints the URL, and on SIGINT/SIGTERM stops every process group it started
(reaped). A start after a crash first stops what the crashed run left behind
(``runstate``). Reads ``pdserve.api`` only; talks to the components over the network.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from pdserve.api import PDCluster
from pdserve.api.component_args import coordinator_argv
from pdserve.api.instance import instance_name
from pdserve.api.manifest import default_cluster, dump_manifest
from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.api.security import SecuritySettings, create_channel
from pdserve.local.runstate import RunState, default_run_dir, stop_groups

PDSERVE = [sys.executable, "-m", "pdserve.cli"]
POOLS = ("prefill", "decode", "hybrid")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--file", help="PDCluster YAML (default: tiny model, 1 prefill + 1 decode)")
    p.add_argument("--host", default="127.0.0.1", help="Coordinator REST listen address")
    p.add_argument("--port", type=int, default=8000, help="Coordinator REST port")
    p.add_argument("--run-dir", type=Path, help="logs and the process list (default: per cluster)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for engines")


def has_coordinator() -> bool:
    return "coordinator" in importlib.import_module("pdserve.cli").COMMANDS


def is_port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class Launcher:
    def __init__(self, state: RunState) -> None:
        self.state = state
        self.procs: dict[str, subprocess.Popen] = {}

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.state.run_dir / f"{name}.log", "w")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen([*PDSERVE, *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**__import__("os").environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        self.procs[name] = proc
        self.state.add(name, proc.pid)
        return proc

    def wait_line(self, name: str, marker: str, timeout_s: float) -> str:
        path = self.state.run_dir / f"{name}.log"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in path.read_text(errors="replace").splitlines():
                if marker in line:
                    return line
            if self.procs[name].poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not start; see {path}:\n{tail(path)}")

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def stop(self) -> None:
        stop_groups([p.pid for p in reversed(self.procs.values())])
        for proc in self.procs.values():
            proc.wait()
        self.state.clear()


def tail(path: Path, num_lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


def get_view(address: str, security: SecuritySettings) -> pb.ClusterView | None:
    import asyncio

    async def go():
        async with create_channel(address, security) as channel:
            return await pb_grpc.ControllerStub(channel).GetView(
                pb.WatchViewRequest(coordinator_id="pdserve-up"), timeout=2, metadata=security.metadata())

    try:
        return asyncio.run(go())
    except grpc.RpcError:
        return None


def run(args: argparse.Namespace) -> int:
    cluster = PDCluster.from_file(args.file) if args.file else default_cluster()
    name = cluster.metadata.name
    state = RunState(args.run_dir or default_run_dir(name))
    if owner := state.live_owner():
        print(f"pdserve up is already running for {name!r} (pid {owner}); stop it first", file=sys.stderr)
        return 1
    if stale := state.kill_stale():
        print(f"stopped leftovers of an earlier run: {', '.join(stale)}")
    if has_coordinator() and not is_port_free(args.host, args.port):
        print(f"{args.host}:{args.port} is in use or not local; pick another with --host/--port",
              file=sys.stderr)
        return 1
    state.run_dir.mkdir(parents=True, exist_ok=True)
    spec_file = state.run_dir / "cluster.yaml"
    spec_file.write_text(dump_manifest(cluster))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    launcher = Launcher(state)
    try:
        return _run(cluster, spec_file, launcher, args, stop)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        print("stopping ...", flush=True)
        launcher.stop()
        print(f"stopped {len(launcher.procs)} processes (logs in {state.run_dir})", flush=True)


def pool_sizes(cluster: PDCluster) -> dict[str, int]:
    """Replicas per pool, for every pool (prefill, decode, hybrid)."""
    return {pool: getattr(cluster.spec, pool).replicas for pool in POOLS}


def instance_args(cluster: PDCluster) -> list[str]:
    """The NodeAgent's ``--instance ID=POOL`` flags: one per replica of every pool."""
    return [f"--instance={instance_name(cluster.metadata.name, pool, i)}={pool}"
            for pool, num in pool_sizes(cluster).items() for i in range(num)]


def describe_pools(sizes: dict[str, int]) -> str:
    return " + ".join(f"{num} {pool}" for pool, num in sizes.items() if num)


def _run(cluster: PDCluster, spec_file: Path, launcher: Launcher, args, stop: threading.Event) -> int:
    spec, name, sizes = cluster.spec, cluster.metadata.name, pool_sizes(cluster)
    transfer = (f"{spec.kv_transfer.mode} over {spec.kv_transfer.transport}"
                if sizes["prefill"] or sizes["decode"] else "colocated")
    print(f"starting cluster {name!r}: model {spec.model.preset or spec.model.path}, "
          f"{describe_pools(sizes)}, {transfer} (logs in {launcher.state.run_dir})")
    launcher.spawn("controller", ["controller", "-f", str(spec_file), "--store", "memory://",
                                  "--host", "127.0.0.1", "--port", "0"])
    line = launcher.wait_line("controller", "controller serving on", 60)
    controller = line.split("serving on ")[1].split()[0]
    instances = instance_args(cluster)
    launcher.spawn("nodeagent", ["nodeagent", "-f", str(spec_file), "--controller", controller,
                                 "--host", "127.0.0.1", "--agent-id", f"{name}-local", "--pin-cpus",
                                 *instances])
    if has_coordinator():
        launcher.spawn("coordinator", coordinator_argv(cluster, args.host, args.port, controller))
    security = SecuritySettings.from_env()
    started, last, is_up = time.monotonic(), "", False
    while not stop.is_set():
        if dead := launcher.dead():
            raise RuntimeError(f"{dead[0]} exited:\n{tail(launcher.state.run_dir / (dead[0] + '.log'))}")
        view = get_view(controller, security)
        progress = describe(view, sizes)
        if progress != last:
            print(f"[{time.monotonic() - started:5.1f}s] {progress}", flush=True)
            last = progress
        if not is_up and view is not None and len(view.instances) >= len(instances):
            is_up = True
            where = (f"http://{url_host(args.host)}:{args.port}" if has_coordinator()
                     else f"controller {controller} (no coordinator in this build)")
            print(f"pdserve is up: {where}  (Ctrl-C stops everything)", flush=True)
        if not is_up and time.monotonic() - started > args.ready_timeout:
            raise RuntimeError(f"engines not ready after {args.ready_timeout:g}s")
        stop.wait(0.5)
    return 0


def url_host(host: str) -> str:
    """What a client on this machine uses to reach a listener on ``host``."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def describe(view: pb.ClusterView | None, sizes: dict[str, int]) -> str:
    """One progress line: ready instances by role against each pool's replicas.

    A role shows when its pool has replicas or instances run in it (PD instances
    switched to hybrid in fallback show as hybrid without a target)."""
    if view is None:
        return "waiting for the controller"
    counts = {r: sum(i.role == r for i in view.instances) for r in POOLS}
    parts = [f"{r} {counts[r]}/{sizes[r]} ready" if sizes[r] else f"{r} {counts[r]}"
             for r in POOLS if sizes[r] or counts[r]]
    return f"mode {view.mode}: " + ", ".join(parts)
