"""The stand-in's kubelet, and its scheduler: every Pod runs as processes on one node.

Scheduling (``Kubelet.sync``): a Pod without ``spec.nodeName`` is bound to the node
(``pods/binding``) when its nodeSelector matches the node's labels and its extended
resources (names with a "/", e.g. nvidia.com/gpu) fit the node's allocatable; else
it stays Pending with PodScheduled False (Unschedulable), as on a real cluster.
Tolerations, affinity and cpu/memory requests are not considered.

One ``PodWorker`` per bound Pod, a pass every ``TICK_S``::

    Pending --volumes, config--> init containers in order, each to exit 0 --> containers
      started --> Running --(all exited, no restart due)--> Succeeded | Failed (latched)
    any --deletionTimestamp--> SIGTERM to every container, SIGKILL after
      deletionGracePeriodSeconds --> DELETE gracePeriodSeconds=0 (the object goes) --> done
    any --object gone or replaced (forced deletion)--> every process killed --> done

Containers restart per restartPolicy with back-off (``containers.ContainerState``).
Status goes through pods/status whenever it changed: phase (the kubelet's rules),
podIP(s), hostIP(s), startTime, conditions PodScheduled / Initialized /
ContainersReady / Ready with lastTransitionTime, (init)containerStatuses. Events
(Scheduled, Started, Unhealthy, Killing) are posted as the kubelet's.

A Pod's files, under <cluster>/pods/<namespace>_<name>_<uid>/: volumes/, etc-hosts,
resolv.conf, hostname, shm/, home/, logs/<container>/<restart>.log, and one run
directory per container start (podinit's spec and pid file, the container's /tmp).
No preStop hooks, no resource limits, no image pulls. Runs on the cluster loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
import uuid
from pathlib import Path

import aiohttp

from tests.e2e.standin.api import (
    ENDPOINTS,
    EVENTS,
    PODS,
    SERVICES,
    Api,
    ApiError,
    is_deleting,
    meta,
)
from tests.e2e.standin.containers import HOME, ConfigError, ContainerState, now_rfc3339
from tests.e2e.standin.network import SHIM_PATH_IN_POD, hosts_file, resolv_conf
from tests.e2e.standin.probes import container_probes
from tests.e2e.standin.volumes import VolumeError, Volumes

TICK_S = 0.2
VOLUME_REFRESH_S = 1.0
log = logging.getLogger(__name__)


def _quantity(text: object) -> float:
    return float(str(text).rstrip("m")) / (1000 if str(text).endswith("m") else 1)


class Kubelet:
    """Owns the node's Pods. ``sync`` runs every ``TICK_S`` from the cluster loop."""

    def __init__(self, api: Api, node: dict, pods_dir: Path, pvc_dir: Path, ca_path: Path, shim: Path,
                 pod_ips, time_scale: float) -> None:
        self.api, self.node, self.pods_dir, self.pvc_dir = api, node, pods_dir, pvc_dir
        self.ca_path, self.shim, self.pod_ips = ca_path, shim, pod_ips
        self.time_scale = time_scale
        self.workers: dict[str, PodWorker] = {}
        self.runs: list = []
        """Every container run started (for the leak check)."""
        self.errors: list[str] = []
        self._done: set[str] = set()
        self._unschedulable: dict[str, str] = {}
        self._background: set[asyncio.Task] = set()
        self.http: aiohttp.ClientSession | None = None
        self.services: list[dict] = []
        self.endpoints: dict[tuple[str, str], dict] = {}

    @property
    def node_name(self) -> str:
        return self.node["metadata"]["name"]

    async def sync(self) -> None:
        if self.http is None:
            self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        self.services = self.api.list(SERVICES)
        self.endpoints = {(meta(e)["namespace"], meta(e)["name"]): e for e in self.api.list(ENDPOINTS)}
        for pod in self.api.list(PODS):
            uid, node = meta(pod)["uid"], (pod.get("spec") or {}).get("nodeName")
            if uid in self.workers or uid in self._done:
                continue
            if not node and not is_deleting(pod):
                await self._schedule(pod)
            elif node == self.node_name:
                worker = self.workers[uid] = PodWorker(self, pod)
                worker.task = asyncio.get_running_loop().create_task(worker.run())
        for uid, worker in list(self.workers.items()):
            if worker.task.done():
                del self.workers[uid]
                self._done.add(uid)
                if not worker.task.cancelled() and worker.task.exception() is not None:
                    exc = worker.task.exception()
                    self.errors.append(f"Pod {worker.key}: " + "".join(traceback.format_exception(exc)))

    def _unfit(self, pod: dict) -> str | None:
        spec, node = pod.get("spec") or {}, self.node
        labels = node["metadata"].get("labels") or {}
        if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
            return "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
        wanted: dict[str, float] = {}
        for container in spec.get("containers") or []:
            for name, qty in ((container.get("resources") or {}).get("limits") or {}).items():
                if "/" in name:
                    wanted[name] = wanted.get(name, 0) + _quantity(qty)
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        short = [n for n, q in wanted.items() if q > _quantity(allocatable.get(n, 0))]
        return f"0/1 nodes are available: 1 Insufficient {', '.join(short)}." if short else None

    async def _schedule(self, pod: dict) -> None:
        m = meta(pod)
        reason = self._unfit(pod)
        if reason is None:
            await self.api.bind(pod, self.node_name)
            await self.post_event(pod, "Scheduled", f"Successfully assigned {m['namespace']}/{m['name']} "
                                                    f"to {self.node_name}", component="default-scheduler")
        elif self._unschedulable.get(m["uid"]) != reason:
            self._unschedulable[m["uid"]] = reason
            await self.api.patch(PODS, m["namespace"], m["name"], {"status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": reason,
                 "lastTransitionTime": now_rfc3339()}]}}, subresource="status")

    async def post_event(self, pod: dict, reason: str, message: str, type_: str = "Normal",
                         component: str = "kubelet") -> None:
        m = meta(pod)
        await self.api.create(EVENTS, {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{m['name']}.{uuid.uuid4().hex[:12]}", "namespace": m["namespace"]},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": m["name"], "namespace": m["namespace"],
                               "uid": m["uid"]},
            "reason": reason, "message": message, "type": type_, "count": 1,
            "source": {"component": component, "host": self.node_name},
            "firstTimestamp": now_rfc3339(), "lastTimestamp": now_rfc3339()})

    def spawn(self, coro) -> None:
        """Run ``coro`` in the background; its failure is recorded in ``errors``."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._reap)

    def _reap(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(f"kubelet: {task.exception()!r}")

    def worker(self, namespace: str, name: str) -> PodWorker | None:
        return next((w for w in self.workers.values() if w.key == (namespace, name)), None)

    async def exec(self, namespace: str, name: str, container: str | None, argv: list[str],
                   timeout_s: float) -> tuple[int, str]:
        """``kubectl exec``: (exit code, output); (-1, why) when the container does not run."""
        worker = self.worker(namespace, name)
        state = next((c for c in worker.containers if container in (None, c.name)), None) if worker else None
        if state is None or state.run is None:
            return -1, f"no running container {container or ''} in pod {namespace}/{name}"
        return await state.run.exec(argv, timeout_s)

    def pod_logs(self, namespace: str, name: str, query: dict) -> str:
        """``GET pods/NAME/log`` (the emulator's hook): ``container``, ``previous``, ``tailLines``."""
        dirs = sorted(self.pods_dir.glob(f"{namespace}_{name}_*"), key=lambda p: p.stat().st_mtime)
        if not dirs:
            return ""
        logs = dirs[-1] / "logs"
        container = query.get("container") or next((p.name for p in sorted(logs.iterdir())), "")
        runs = sorted((logs / container).glob("*.log"), key=lambda p: int(p.stem)) if container else []
        if query.get("previous") in ("true", "1"):
            runs = runs[:-1]
        text = runs[-1].read_text(errors="replace") if runs else ""
        tail = query.get("tailLines")
        return "\n".join(text.splitlines()[-int(tail):]) + "\n" if tail and text else text

    async def shutdown(self, grace_s: float) -> None:
        """Teardown: stop every container (SIGTERM, SIGKILL after ``grace_s``), end workers."""
        workers = list(self.workers.values())
        await asyncio.gather(*(c.stop(grace_s) for w in workers for c in w.all_containers),
                             return_exceptions=True)
        for worker in workers:
            worker.task.cancel()
        await asyncio.gather(*(w.task for w in workers), return_exceptions=True)
        if self.http is not None:
            await self.http.close()


class PodWorker:
    """One Pod on the node, from binding to the removal of its object."""

    def __init__(self, kubelet: Kubelet, pod: dict) -> None:
        self.kubelet, self.api, self.pod = kubelet, kubelet.api, pod
        m, spec = meta(pod), pod.get("spec") or {}
        self.uid, self.key = m["uid"], (m["namespace"], m["name"])
        self.dir = kubelet.pods_dir / f"{m['namespace']}_{m['name']}_{m['uid']}"
        self.hostname = (spec.get("hostname") or m["name"])[:63]
        self.restart_policy = spec.get("restartPolicy", "Always")
        self.grace_s = spec.get("terminationGracePeriodSeconds", 30)
        self.time_scale = kubelet.time_scale
        self.init_containers = [ContainerState(c, self, is_init=True) for c in spec.get("initContainers") or []]
        self.containers = [ContainerState(c, self) for c in spec.get("containers") or []]
        self.volumes = Volumes(self.api, pod, self.dir, kubelet.pvc_dir, kubelet.ca_path)
        self.ip = ""
        self.task: asyncio.Task | None = None
        self._volume_error: str | None = "volumes not set up yet"
        self._volumes_at = 0.0
        self._hosts = ""
        self._status: dict | None = None
        self._conditions: dict[str, tuple[str, str]] = {}
        self._terminal_phase: str | None = None
        self._started_at = now_rfc3339()

    @property
    def all_containers(self) -> list[ContainerState]:
        return [*self.init_containers, *self.containers]

    def log_path(self, container: str, restart: int) -> Path:
        path = self.dir / "logs" / container / f"{restart}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def sandbox_mounts(self) -> list[dict]:
        d = self.dir
        return [{"source": str(d / "etc-hosts"), "target": "/etc/hosts"},
                {"source": str(d / "resolv.conf"), "target": "/etc/resolv.conf"},
                {"source": str(d / "hostname"), "target": "/etc/hostname"},
                {"source": str(d / "shm"), "target": "/dev/shm"},
                {"source": str(d / "home"), "target": HOME},
                {"source": str(self.kubelet.shim), "target": SHIM_PATH_IN_POD, "readonly": True}]

    def mounts(self, container: dict) -> list[dict]:
        try:
            return self.volumes.mounts(container)
        except VolumeError as exc:
            raise ConfigError(str(exc)) from None

    def probes_for(self, container: dict, run) -> dict:
        return container_probes(container, self.ip, self.time_scale, self.kubelet.http, run.exec,
                                time.monotonic())

    def event(self, message: str, reason: str = "Unhealthy", type_: str = "Warning") -> None:
        """Post an Event about the Pod in the background (called from sync code)."""
        self.kubelet.spawn(self.kubelet.post_event(self.pod, reason, message, type_))

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            for container in self.all_containers:
                container.kill()

    async def _run(self) -> None:
        self.ip = next(self.kubelet.pod_ips)
        for sub in ("shm", "home", "logs"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        (self.dir / "shm").chmod(0o1777)
        (self.dir / "hostname").write_text(self.hostname + "\n")
        (self.dir / "resolv.conf").write_text(resolv_conf(self.key[0]))
        await self._sync_status()
        while True:
            pod = self.api.get(PODS, *self.key)
            if pod is None or meta(pod)["uid"] != self.uid:
                return
            self.pod = pod
            if is_deleting(pod):
                await self._terminate(meta(pod).get("deletionGracePeriodSeconds", self.grace_s))
                return
            self._write_hosts()
            now = time.monotonic()
            if self._volume_error or now - self._volumes_at >= VOLUME_REFRESH_S:
                self._prepare_volumes(now)
            if not self._volume_error:
                self._step_containers(now)
            try:
                await self._sync_status()
            except ApiError as exc:  # written again next pass
                self.kubelet.errors.append(f"Pod {self.key}: status not written: {exc}")
            await asyncio.sleep(TICK_S)

    def _prepare_volumes(self, now: float) -> None:
        try:
            self.volumes.pod = self.pod
            self.volumes.prepare()
            self._volume_error, self._volumes_at = None, now
        except VolumeError as exc:
            self._volume_error = str(exc)

    def _step_containers(self, now: float) -> None:
        pending_init = next((c for c in self.init_containers if not (c.is_final and c.exit_code == 0)), None)
        if pending_init is not None:
            if not pending_init.is_final:
                pending_init.step(now)
            return
        for container in self.containers:
            was_running = container.is_running
            container.step(now)
            if container.is_running and not was_running:
                self.event(f"Started container {container.name}", "Started", "Normal")

    def _write_hosts(self) -> None:
        text = hosts_file({**self.pod, "status": {**(self.pod.get("status") or {}), "podIP": self.ip}},
                          self.kubelet.services, self.kubelet.endpoints)
        if text != self._hosts:
            (self.dir / "etc-hosts").write_text(text)  # in place: bind mounts see the same inode
            self._hosts = text

    async def _terminate(self, grace_s: float) -> None:
        self.event(f"Stopping containers (grace period {grace_s:g}s)", "Killing", "Normal")
        await asyncio.gather(*(c.stop(grace_s) for c in self.all_containers))
        await self._sync_status()
        await self.api.delete(PODS, *self.key, grace_s=0)

    def _phase(self, is_initialized: bool) -> str:
        if self._terminal_phase:
            return self._terminal_phase
        if any(c.is_final and c.exit_code != 0 for c in self.init_containers):
            return "Failed"
        if not is_initialized:
            return "Pending"
        pending = running = stopped = succeeded = 0
        for c in self.containers:
            if c.is_running:
                running += 1
            elif c.exit_code is None:
                pending += 1
            else:
                stopped += 1
                succeeded += c.is_final and c.exit_code == 0
        if pending or not self.containers:
            return "Pending"
        if running or self.restart_policy == "Always":
            return "Running"
        if stopped == succeeded:
            return "Succeeded"
        return "Failed" if self.restart_policy == "Never" else "Running"

    def _condition(self, type_: str, is_true: bool, reason: str | None = None, message: str = "") -> dict:
        status = "True" if is_true else "False"
        if self._conditions.get(type_, ("",))[0] != status:
            self._conditions[type_] = (status, now_rfc3339())
        cond = {"type": type_, "status": status, "lastTransitionTime": self._conditions[type_][1]}
        return cond | ({"reason": reason, "message": message} if reason and not is_true else {})

    def _build_status(self) -> dict:
        is_initialized = all(c.is_final and c.exit_code == 0 for c in self.init_containers)
        phase = self._phase(is_initialized)
        if phase in ("Succeeded", "Failed"):
            self._terminal_phase = phase
        unready = [c.name for c in self.containers if not c.is_ready]
        why = ("PodCompleted", "") if phase in ("Succeeded", "Failed") else (
            "ContainersNotReady", f"containers with unready status: [{' '.join(unready)}]")
        is_ready = not unready and phase == "Running"
        status = {
            "phase": phase, "hostIP": self.kubelet.node["status"]["addresses"][0]["address"],
            "podIP": self.ip, "podIPs": [{"ip": self.ip}], "startTime": self._started_at,
            "conditions": [self._condition("PodScheduled", True),
                           self._condition("Initialized", is_initialized, "ContainersNotInitialized"),
                           self._condition("ContainersReady", is_ready, *why),
                           self._condition("Ready", is_ready, *why)],
            "containerStatuses": [self._container_status(c) for c in self.containers],
        }
        status["hostIPs"] = [{"ip": status["hostIP"]}]
        if self.init_containers:
            status["initContainerStatuses"] = [self._container_status(c) for c in self.init_containers]
        if self._volume_error and not any(c.exit_code is not None or c.is_running for c in self.all_containers):
            for cs in status["containerStatuses"]:
                cs["state"] = {"waiting": {"reason": "ContainerCreating", "message": self._volume_error}}
        return status

    @staticmethod
    def _container_status(c: ContainerState) -> dict:
        return {"name": c.name, "image": c.spec.get("image", ""), "imageID": "", "containerID": c.container_id,
                "ready": c.is_ready, "started": c.is_started, "restartCount": c.restart_count,
                "state": c.state, "lastState": c.last_state}

    async def _sync_status(self) -> None:
        status = self._build_status()
        if status != self._status:
            await self.api.patch(PODS, *self.key, {"status": status}, subresource="status")
            self._status = status
