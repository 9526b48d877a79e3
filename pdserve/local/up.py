"""``pdserve up``: run a PDCluster on this machine as processes and stop them all on Ctrl-C.

Starts the Controller (in-memory store), one NodeAgent with every instance of
both pools (it launches the engines) and, when this build has one, the
Coordinator on ``--port``. Shows progress from the Controller's view while models
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
from pdserve.api.manifest import default_cluster, dump_manifest
from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.api.security import SecuritySettings, create_channel
from pdserve.local.runstate import RunState, default_run_dir, stop_groups

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--file", help="PDCluster YAML (default: tiny model, 1 prefill + 1 decode)")
    p.add_argument("--port", type=int, default=8000, help="Coordinator REST port")
    p.add_argument("--run-dir", type=Path, help="logs and the process list (default: per cluster)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for engines")


def has_coordinator() -> bool:
    return "coordinator" in importlib.import_module("pdserve.cli").COMMANDS


def is_port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
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
    if has_coordinator() and not is_port_free(args.port):
        print(f"port {args.port} is in use; pick another with --port", file=sys.stderr)
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


def _run(cluster: PDCluster, spec_file: Path, launcher: Launcher, args, stop: threading.Event) -> int:
    spec, name = cluster.spec, cluster.metadata.name
    print(f"starting cluster {name!r}: model {spec.model.preset or spec.model.path}, "
          f"{spec.prefill.replicas} prefill + {spec.decode.replicas} decode, "
          f"{spec.kv_transfer.mode} over {spec.kv_transfer.transport} (logs in {launcher.state.run_dir})")
    launcher.spawn("controller", ["controller", "-f", str(spec_file), "--store", "memory://",
                                  "--host", "127.0.0.1", "--port", "0"])
    line = launcher.wait_line("controller", "controller serving on", 60)
    controller = line.split("serving on ")[1].split()[0]
    instances = [f"--instance={name}-{role}-{i}={role}" for role in ("prefill", "decode")
                 for i in range(getattr(spec, role).replicas)]
    launcher.spawn("nodeagent", ["nodeagent", "-f", str(spec_file), "--controller", controller,
                                 "--host", "127.0.0.1", "--agent-id", f"{name}-local", *instances])
    if has_coordinator():
        launcher.spawn("coordinator", ["coordinator", "--controller", controller, "--port", str(args.port)])
    security = SecuritySettings.from_env()
    started, last, is_up = time.monotonic(), "", False
    while not stop.is_set():
        if dead := launcher.dead():
            raise RuntimeError(f"{dead[0]} exited:\n{tail(launcher.state.run_dir / (dead[0] + '.log'))}")
        view = get_view(controller, security)
        progress = describe(view, spec.prefill.replicas, spec.decode.replicas)
        if progress != last:
            print(f"[{time.monotonic() - started:5.1f}s] {progress}", flush=True)
            last = progress
        if not is_up and view is not None and len(view.instances) >= len(instances):
            is_up = True
            where = (f"http://127.0.0.1:{args.port}" if has_coordinator()
                     else f"controller {controller} (no coordinator in this build)")
            print(f"pdserve is up: {where}  (Ctrl-C stops everything)", flush=True)
        if not is_up and time.monotonic() - started > args.ready_timeout:
            raise RuntimeError(f"engines not ready after {args.ready_timeout:g}s")
        stop.wait(0.5)
    return 0


def describe(view: pb.ClusterView | None, num_prefill: int, num_decode: int) -> str:
    if view is None:
        return "waiting for the controller"
    counts = {r: sum(i.role == r for i in view.instances) for r in ("prefill", "decode", "hybrid")}
    text = f"mode {view.mode}: prefill {counts['prefill']}/{num_prefill} ready, " \
           f"decode {counts['decode']}/{num_decode} ready"
    return text + (f", hybrid {counts['hybrid']}" if counts["hybrid"] else "")
