"""Containers as processes: a container spec's command line and environment, and one
run of it under podinit (``podinit.py``).

The image: every image is the pdserve image, taken from the host. Its entrypoint is
``pdserve`` (the console script next to the test's interpreter), WORKDIR and HOME
are /home/pdserve (a directory of the Pod), PATH has that interpreter's bin directory
first, and ``PYTHONUNBUFFERED=1`` keeps logs timely. ``command`` replaces the
entrypoint and ``args`` the image's CMD; ``$(VAR)`` in command, args and env values
expands as the kubelet does (``$$`` escapes; an unknown name stays as written).

The environment: the image's, then ``HOSTNAME`` and the Service links
(``<NAME>_SERVICE_HOST``, ``<NAME>_PORT_<port>_TCP``, ...: the Pod's namespace's
Services unless ``enableServiceLinks`` is false, and ``kubernetes`` always, which
gives in-cluster clients ``KUBERNETES_SERVICE_HOST``/``PORT``), then ``envFrom``,
then ``env`` in order (``value``, ``fieldRef``:
metadata.name/namespace/uid, metadata.labels['k'] / annotations['k'], spec.nodeName,
spec.serviceAccountName, status.podIP(s), status.hostIP(s); ``configMapKeyRef``;
``secretKeyRef``; not ``resourceFieldRef``), then the shim's ``STANDIN_POD_IP`` and
``LD_PRELOAD``. securityContext (users, capabilities, read-only root) is not applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.standin.api import CONFIGMAPS, SECRETS, Api
from tests.e2e.standin.network import SHIM_PATH_IN_POD
from tests.e2e.standin.volumes import config_map_data, secret_data

BIN_DIR = Path(sys.executable).parent
PODINIT = Path(__file__).resolve().parent / "podinit.py"
REPO_ROOT = Path(__file__).resolve().parents[3]
HOME = "/home/pdserve"
IMAGE_CMD = ["--help"]
IMAGE_ENV = {"PATH": f"{BIN_DIR}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "HOME": HOME, "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}


def image_under_tmp(pod_tmp: Path) -> list[dict]:
    """The image (this checkout and its interpreter's environment) where it lives under
    /tmp, which the Pod's own /tmp would hide: bound back at the same path, read-only."""
    mounts = []
    for source in sorted({REPO_ROOT, Path(sys.prefix).resolve()}):
        if source.is_relative_to("/tmp"):
            (pod_tmp / source.relative_to("/tmp")).mkdir(parents=True, exist_ok=True)
            mounts.append({"source": str(source), "target": str(source), "readonly": True})
    return mounts


class ConfigError(Exception):
    """The container cannot be configured yet (CreateContainerConfigError)."""


def expand(text: str, env: dict[str, str]) -> str:
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        if text.startswith("$(", i) and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2:end]
            out.append(env[name] if name in env else text[i:end + 1])
            i = end + 1
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


def field_value(pod: dict, path: str) -> str:
    meta, status = pod["metadata"], pod.get("status") or {}
    if m := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    values = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "spec.nodeName": (pod.get("spec") or {}).get("nodeName"),
              "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName", "default"),
              "status.podIP": status.get("podIP"), "status.hostIP": status.get("hostIP"),
              "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs") or []),
              "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs") or [])}
    if path not in values:
        raise ConfigError(f"fieldRef {path!r} is not supported")
    return values[path] or ""


def _key_ref(api: Api, namespace: str, ref: dict, resource, decode) -> str | None:
    obj = api.get(resource, namespace, ref["name"])
    data = decode(obj) if obj is not None else {}
    if ref["key"] in data:
        return data[ref["key"]].decode()
    if ref.get("optional"):
        return None
    raise ConfigError(f"{resource.plural[:-1]} {ref['name']!r} has no key {ref['key']!r}")


def service_links(pod: dict, services: list[dict]) -> dict[str, str]:
    """The kubelet's Docker-link variables: every Service of the Pod's namespace with a
    ClusterIP (unless enableServiceLinks is false), and ``kubernetes`` always."""
    namespace, env = pod["metadata"]["namespace"], {}
    with_links = (pod.get("spec") or {}).get("enableServiceLinks", True)
    for svc in services:
        m, spec = svc["metadata"], svc.get("spec") or {}
        is_master = (m["namespace"], m["name"]) == ("default", "kubernetes")
        ip, ports = spec.get("clusterIP"), spec.get("ports") or []
        if not (is_master or (with_links and m["namespace"] == namespace)) or ip in (None, "", "None") or not ports:
            continue
        prefix = m["name"].upper().replace("-", "_")
        env[f"{prefix}_SERVICE_HOST"], env[f"{prefix}_SERVICE_PORT"] = ip, str(ports[0]["port"])
        env[f"{prefix}_PORT"] = f"{ports[0].get('protocol', 'TCP').lower()}://{ip}:{ports[0]['port']}"
        for port in ports:
            proto = port.get("protocol", "TCP")
            if port.get("name"):
                env[f"{prefix}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
            base = f"{prefix}_PORT_{port['port']}_{proto}"
            env.update({base: f"{proto.lower()}://{ip}:{port['port']}", f"{base}_PROTO": proto.lower(),
                        f"{base}_PORT": str(port["port"]), f"{base}_ADDR": ip})
    return env


def container_env(api: Api, pod: dict, container: dict, services: list[dict]) -> dict[str, str]:
    namespace = pod["metadata"]["namespace"]
    env = {**IMAGE_ENV, "HOSTNAME": (pod.get("spec") or {}).get("hostname") or pod["metadata"]["name"],
           **service_links(pod, services)}
    for source in container.get("envFrom") or []:
        ref = source.get("configMapRef") or source.get("secretRef") or {}
        resource, decode = (CONFIGMAPS, config_map_data) if "configMapRef" in source else (SECRETS, secret_data)
        obj = api.get(resource, namespace, ref.get("name"))
        if obj is None and not ref.get("optional"):
            raise ConfigError(f"{resource.plural[:-1]} {ref.get('name')!r} not found")
        env.update({source.get("prefix", "") + k: v.decode() for k, v in (decode(obj) if obj else {}).items()})
    for var in container.get("env") or []:
        value_from = var.get("valueFrom")
        if value_from is None:
            value = expand(var.get("value", ""), env)
        elif "fieldRef" in value_from:
            value = field_value(pod, value_from["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in value_from:
            value = _key_ref(api, namespace, value_from["configMapKeyRef"], CONFIGMAPS, config_map_data)
        elif "secretKeyRef" in value_from:
            value = _key_ref(api, namespace, value_from["secretKeyRef"], SECRETS, secret_data)
        else:
            raise ConfigError(f"env {var['name']}: {sorted(value_from)} is not supported")
        if value is not None:
            env[var["name"]] = value
    env.update(STANDIN_POD_IP=(pod.get("status") or {}).get("podIP", ""), LD_PRELOAD=SHIM_PATH_IN_POD)
    return env


def container_argv(container: dict, env: dict[str, str]) -> list[str]:
    """``command`` (else the entrypoint) and ``args`` (else, without ``command``, the CMD)."""
    entrypoint = ["pdserve"] if (BIN_DIR / "pdserve").exists() else [sys.executable, "-m", "pdserve.cli"]
    command = container.get("command") or entrypoint
    args = container.get("args") or ([] if container.get("command") else IMAGE_CMD)
    return [expand(a, env) for a in [*command, *args]]


class Run:
    """One run of a container: podinit, the container's PID namespace, its log file.
    Started and stopped by the Pod worker on the cluster loop."""

    def __init__(self, run_dir: Path, log_path: Path) -> None:
        self.dir, self.log_path = run_dir, log_path
        self.pid_file = run_dir / "pid"
        self.popen: subprocess.Popen | None = None
        self.started_at = time.time()
        self.env: dict[str, str] = {}

    def start(self, spec: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.env = spec["env"]
        spec_path = self.dir / "spec.json"
        spec_path.write_text(json.dumps({**spec, "pid_file": str(self.pid_file), "parent_pid": os.getpid()}))
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen([sys.executable, str(PODINIT), str(spec_path)], stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        self.started_at = time.time()

    def exit_code(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    @property
    def init_pid(self) -> int | None:
        """Host PID of the container's PID 1 (None until its command runs)."""
        try:
            return int(self.pid_file.read_text())
        except (OSError, ValueError):
            return None

    def kill(self, with_podinit: bool = True) -> None:
        """SIGKILL to the container's PID 1 (the kernel kills the rest of its PID
        namespace; podinit reaps it and exits), and to podinit itself if asked."""
        for pid in (self.init_pid, self.popen.pid if self.popen and with_podinit else None):
            if pid is not None and self.exit_code() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    async def _wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.exit_code() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.exit_code() is not None

    async def stop(self, grace_s: float) -> int:
        """SIGTERM to the container's PID 1; SIGKILL after ``grace_s``. Returns the exit code."""
        if self.exit_code() is None:
            self.popen.send_signal(signal.SIGTERM)  # podinit relays it to PID 1
            if not await self._wait(grace_s):
                self.kill(with_podinit=False)
                if not await self._wait(2.0):
                    self.kill()
                    await self._wait(5.0)
        return self.exit_code()

    async def exec(self, argv: list[str], timeout_s: float) -> tuple[int, str]:
        """Run ``argv`` inside the container (its mount, UTS, IPC and PID namespaces, its
        root and working directory, its environment). Returns (exit code, output)."""
        deadline = time.monotonic() + 10.0
        while self.init_pid is None and self.exit_code() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # the container is still being set up
        pid = self.init_pid
        if pid is None or self.exit_code() is not None:
            return -1, "the container is not running"
        env = {k: v for k, v in self.env.items() if k != "LD_PRELOAD"}  # nsenter itself runs on the host
        proc = await asyncio.create_subprocess_exec(
            "nsenter", "-t", str(pid), "-m", "-u", "-i", "-p", "-r", "-w", "--",
            "env", f"LD_PRELOAD={self.env.get('LD_PRELOAD', '')}", *argv,
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            return -1, f"timed out after {timeout_s:g}s"
        return proc.returncode, out.decode(errors="replace")


BACKOFF_FIRST_S, BACKOFF_MAX_S, BACKOFF_RESET_AFTER_S = 10.0, 300.0, 600.0


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class ContainerState:
    """One container of a Pod across its runs: start, exit, restart per restartPolicy
    (init containers: ``Always`` acts as ``OnFailure``) with the kubelet's back-off, and
    the probes of the current run. Driven by ``PodWorker`` calling ``step`` each pass.

    States: waiting (ContainerCreating | CreateContainerConfigError | CrashLoopBackOff)
    -> running -> terminated; terminated is final when no restart is due."""

    def __init__(self, spec: dict, worker, is_init: bool = False) -> None:
        self.spec, self.worker, self.is_init = spec, worker, is_init
        self.name = spec["name"]
        self.run: Run | None = None
        self.restart_count = 0
        self.state: dict = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict = {}
        self.probes: dict | None = None
        """The current run's probes, from the moment its command runs."""
        self.is_final = False
        self.exit_code: int | None = None
        self._backoff_s, self._next_start_at = 0.0, 0.0
        self._killing: asyncio.Task | None = None

    @property
    def is_running(self) -> bool:
        return self.run is not None and self.run.exit_code() is None

    @property
    def is_started(self) -> bool:
        """Its command runs (podinit reported it) and its startup probe, if any, passed."""
        if not self.is_running or self.probes is None:
            return False
        return self.probes["startup"].is_passing if "startup" in self.probes else True

    @property
    def is_ready(self) -> bool:
        if not self.is_started:
            return False
        readiness = self.probes.get("readiness")
        return readiness.is_passing if readiness else True

    @property
    def container_id(self) -> str:
        return f"standin://{self.run.init_pid or self.run.popen.pid}" if self.run and self.run.popen else ""

    def step(self, now: float) -> None:
        if self.run is not None:
            code = self.run.exit_code()
            if code is None:
                self._watch(now)
            else:
                self._exited(code, now)
        elif not self.is_final and now >= self._next_start_at:
            self._start(now)

    def _watch(self, now: float) -> None:
        if self.probes is None:  # probes start with the command, as the kubelet's do
            if self.run.init_pid is None:
                return
            self.probes = self.worker.probes_for(self.spec, self.run)
        startup = self.probes.get("startup")
        is_started = startup is None or startup.is_passing
        for kind, probe in self.probes.items():
            if (kind == "startup") != is_started:
                probe.tick(now)  # the startup probe until it passes, then the others
        failed = [k for k in ("startup", "liveness") if k in self.probes
                  and self.probes[k].num_failures >= self.probes[k].settings["failureThreshold"]]
        if failed and self._killing is None:
            probe = self.probes[failed[0]]
            grace_s = probe.spec.get("terminationGracePeriodSeconds", self.worker.grace_s)
            self.worker.event(f"container {self.name} failed its {failed[0]} probe ({probe.last_message}); "
                              f"restarting it")
            self._killing = asyncio.get_running_loop().create_task(self.run.stop(grace_s))

    def _exited(self, code: int, now: float, may_restart: bool = True) -> None:
        if self.run is None:
            return
        self.exit_code = code
        terminated = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                     "startedAt": self.state.get("running", {}).get("startedAt"),
                                     "finishedAt": now_rfc3339(), "containerID": self.container_id}}
        for probe in (self.probes or {}).values():
            probe.cancel()
        ran_s = time.time() - self.run.started_at
        self.run, self.probes, self._killing = None, None, None
        policy = self.worker.restart_policy
        if self.is_init and policy == "Always":
            policy = "OnFailure"
        if not may_restart or not (policy == "Always" or (policy == "OnFailure" and code != 0)):
            self.state, self.is_final = terminated, True
            return
        if ran_s >= BACKOFF_RESET_AFTER_S * self.worker.time_scale:
            self._backoff_s = 0.0
        self._next_start_at = now + self._backoff_s
        self.last_state = terminated
        self.state = {"waiting": {"reason": "CrashLoopBackOff" if self._backoff_s else "ContainerCreating"}}
        self._backoff_s = min(max(self._backoff_s * 2, BACKOFF_FIRST_S * self.worker.time_scale),
                              BACKOFF_MAX_S * self.worker.time_scale)

    def _start(self, now: float) -> None:
        worker = self.worker
        try:
            env = container_env(worker.api, worker.pod, self.spec, worker.kubelet.services)
            mounts = worker.mounts(self.spec)
        except ConfigError as exc:
            self.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
            return
        if self.exit_code is not None:
            self.restart_count += 1
        run = Run(worker.dir / "runs" / f"{self.name}-{self.restart_count}",
                  worker.log_path(self.name, self.restart_count))
        (run.dir / "tmp").mkdir(parents=True, exist_ok=True)
        (run.dir / "tmp").chmod(0o1777)
        run.start({"root": str(run.dir / "root"), "hostname": worker.hostname, "cwd": self.spec.get("workingDir")
                   or HOME, "argv": container_argv(self.spec, env), "env": env,
                   "mounts": [*worker.sandbox_mounts(), {"source": str(run.dir / "tmp"), "target": "/tmp"},
                              *image_under_tmp(run.dir / "tmp"), *mounts]})
        self.run = run
        worker.kubelet.runs.append(run)
        self.state = {"running": {"startedAt": now_rfc3339()}}
        self.probes = None

    async def stop(self, grace_s: float) -> None:
        """Stop for good (Pod deletion, teardown): SIGTERM, SIGKILL after ``grace_s``."""
        self.is_final = True
        if self.run is not None:
            self._exited(await self.run.stop(grace_s), time.monotonic(), may_restart=False)

    def kill(self) -> None:
        if self.run is not None:
            self.run.kill()
