"""``Cluster``: the one-machine Kubernetes stand-in, as a context manager.

One background thread runs one event loop holding everything: the API emulator
(``tests.kmock_emulator.StrictEmulator`` plus the scale subresource of CRDs,
``scale.ScalingEmulator``; plain HTTP on 127.0.0.1), its TLS endpoint on the node IP
(what kubeconfig and in-cluster clients use), the kubelet, the Deployment, Endpoints,
garbage-collection and volume controllers, and the Service proxy. Tests talk to it from their own thread through ``Cluster.kubectl``.

Start: prerequisites checked (root, nsenter, openssl, a C compiler: else
``StandinUnavailable``, which the fixture turns into a skip); the socket shim built;
the ``default`` namespace, the node, and the ``kubernetes`` Service (its Endpoints:
the TLS endpoint) created; a kubeconfig written. Stop (also after a failed test):
controllers cancelled, every container stopped (SIGTERM, then SIGKILL after
``stop_grace_s``), listeners closed, the loop ended; ``leaks()`` lists any process
left. Mounts never need cleaning: they live only in the containers' own mount
namespaces, which the kernel drops with their last process.

Everything lives under ``root``: pods/ (one directory per Pod), volumes/ (one per
PersistentVolumeClaim), tls/, kubeconfig.

Real clients: the kubeconfig (https to the node IP, the stand-in's CA, a token nobody
checks) works for kopf, the kubernetes Python client and kubectl's get, apply
(``--validate=false``: no OpenAPI document is served), scale (custom resources with a
scale subresource), wait, logs and delete; not for ``kubectl exec``/``port-forward``
(no streaming protocols), protobuf requests
(``kubectl create <kind>``) or server-side printing (``kubectl get`` shows NAME and
AGE only). Tests use ``Cluster.kubectl`` instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
import time
import traceback
from collections.abc import Coroutine
from pathlib import Path

import kmock
import yaml

from tests.e2e.standin.api import ENDPOINTS, NAMESPACES, NODES, SERVICES, Api, meta
from tests.e2e.standin.controllers import (
    TICK_S,
    DeploymentController,
    EndpointsController,
    GarbageCollector,
    VolumeBinder,
)
from tests.e2e.standin.kubectl import Kubectl
from tests.e2e.standin.kubelet import TICK_S as KUBELET_TICK_S
from tests.e2e.standin.kubelet import Kubelet
from tests.e2e.standin.network import (
    ApiEndpoint,
    ServiceProxy,
    addresses,
    build_netshim,
    hosts_file,
    make_certificates,
)
from tests.e2e.standin.scale import ScalingEmulator
from tests.e2e.standin.volumes import SERVICE_ACCOUNT_TOKEN

NODE_NAME = "standin"
API_PORT = 6443
log = logging.getLogger(__name__)


def _is_alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class StandinUnavailable(Exception):
    """This machine cannot run the stand-in (not root, a tool missing)."""


def check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise StandinUnavailable("the cluster stand-in needs root (mount and PID namespaces)")
    for tool in ("nsenter", "openssl"):
        if shutil.which(tool) is None:
            raise StandinUnavailable(f"the cluster stand-in needs {tool}")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        raise StandinUnavailable("the cluster stand-in needs a C compiler (cc) for its socket shim")


class Cluster:
    """Use as ``with Cluster(tmp_path) as cluster:``; ``cluster.kubectl`` talks to it."""

    def __init__(self, root: Path, *, time_scale: float = 1.0, stop_grace_s: float = 2.0,
                 node_labels: dict[str, str] | None = None, allocatable: dict[str, str] | None = None) -> None:
        self.root, self.time_scale, self.stop_grace_s = Path(root), time_scale, stop_grace_s
        self.pod_ips = addresses(10)
        self.node_ip = next(self.pod_ips).rsplit(".", 1)[0] + ".1"
        self.node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE_NAME, "labels": {
            "kubernetes.io/hostname": NODE_NAME, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
            **(node_labels or {})}}, "status": {
            "addresses": [{"type": "InternalIP", "address": self.node_ip}, {"type": "Hostname", "address": NODE_NAME}],
            "allocatable": {"cpu": str(os.cpu_count()), "memory": "16Gi", "pods": "110", **(allocatable or {})},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}}
        self.errors: list[str] = []
        self.kubeconfig = self.root / "kubeconfig"
        self.api_url = ""
        self.kubectl: Kubectl | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.kubelet: Kubelet | None = None
        self.emulator: ScalingEmulator | None = None
        self._thread: threading.Thread | None = None
        self._ready, self._stopping = threading.Event(), None
        self._failure: BaseException | None = None

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def pvc_dir(self, namespace: str, claim: str) -> Path:
        """The host directory behind PersistentVolumeClaim ``claim`` (made on first use)."""
        path = self.root / "volumes" / namespace / claim
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start(self) -> Cluster:
        check_prerequisites()
        for sub in ("pods", "volumes", "tls"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.shim = build_netshim(self.root)
        self._thread = threading.Thread(target=self._main, name="cluster-standin", daemon=True)
        self._thread.start()
        if not self._ready.wait(60) or self._failure is not None:
            self.stop()
            raise RuntimeError(f"the cluster stand-in did not start: {self._failure!r}")
        self.kubectl = Kubectl(self)
        return self

    def call(self, coro: Coroutine, timeout_s: float = 60.0):
        """Run ``coro`` on the cluster loop from a test's thread; returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - surfaced by start() and stop()
            self._failure = exc
            self.errors.append("".join(traceback.format_exception(exc)))
            self._ready.set()

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self.emulator = emulator = ScalingEmulator(with_pdserve_crds=False, service_ips=addresses(11))
        async with emulator, kmock.Server(emulator) as server:
            self.api_url = str(server.url).rstrip("/")
            api = Api(emulator, self.api_url)
            endpoint = await self._bootstrap(api, server.port)
            self.kubelet = Kubelet(api, self.node, self.root / "pods", self.root / "volumes",
                                   self.root / "tls" / "ca.crt", self.shim, self.pod_ips, self.time_scale)
            emulator.pod_logs = self.kubelet.pod_logs
            proxy = ServiceProxy()
            loops = [self._every(KUBELET_TICK_S, self.kubelet.sync, "kubelet")] + [
                self._every(TICK_S, c.sync, type(c).__name__) for c in (
                    DeploymentController(api), EndpointsController(api, proxy), GarbageCollector(api),
                    VolumeBinder(api))]
            tasks = [asyncio.create_task(coro) for coro in loops]
            self._ready.set()
            try:
                await self._stopping.wait()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await self.kubelet.shutdown(self.stop_grace_s)
                self.errors.extend(self.kubelet.errors)
                await proxy.close()
                await endpoint.close()
                await api.close()

    async def _bootstrap(self, api: Api, emulator_port: int) -> ApiEndpoint:
        await api.create(NAMESPACES, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}})
        await api.create(NODES, self.node)
        service = await api.create(SERVICES, {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": "kubernetes", "namespace": "default"},
            "spec": {"ports": [{"name": "https", "port": 443, "targetPort": API_PORT}]}})
        cluster_ip = service["spec"]["clusterIP"]
        _, cert, key = make_certificates(self.root / "tls", [cluster_ip, self.node_ip, "127.0.0.1"], [
            "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local",
            "localhost"])
        endpoint = ApiEndpoint(self.node_ip, API_PORT, ("127.0.0.1", emulator_port), cert, key)
        await endpoint.start()
        await api.create(ENDPOINTS, {
            "apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "kubernetes", "namespace": "default"},
            "subsets": [{"addresses": [{"ip": self.node_ip}], "ports": [{"name": "https", "port": API_PORT}]}]})
        self._write_kubeconfig()
        return endpoint

    def _write_kubeconfig(self) -> None:
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {
                "server": f"https://{self.node_ip}:{API_PORT}",
                "certificate-authority": str(self.root / "tls" / "ca.crt")}}],
            "users": [{"name": "standin", "user": {"token": SERVICE_ACCOUNT_TOKEN}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "standin",
                                                         "namespace": "default"}}]}))

    async def _every(self, period_s: float, sync, name: str) -> None:
        while True:
            try:
                await sync()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a stand-in bug: kept for the teardown check
                self.errors.append(f"{name}: {exc!r}\n{traceback.format_exc()}")
                log.warning("%s failed: %r", name, exc)
            await asyncio.sleep(period_s)

    def stop(self) -> None:
        if self._thread is None:
            return
        if self.loop is not None and self._stopping is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(self.stop_grace_s + 30)
        if self._thread.is_alive():
            self.errors.append("the cluster loop did not stop")
        self._thread = None

    def leaks(self, wait_s: float = 3.0) -> list[str]:
        """Container processes still alive after ``wait_s`` (after ``stop`` there must be
        none; a killed process may take a moment to be reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            left = [f"{run.dir.name}: pid {pid}" for run in (self.kubelet.runs if self.kubelet else [])
                    for pid in (run.popen.pid if run.popen and run.exit_code() is None else None, run.init_pid)
                    if pid is not None and _is_alive(pid)]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.1)

    def diagnostics(self, log_lines: int = 30) -> str:
        """What to read when a test times out: every Pod's state, warnings, log tails."""
        k, out = self.kubectl, []
        for pod in k.list("Pod", all_namespaces=True):
            m, status = meta(pod), pod.get("status") or {}
            states = [f"{c['name']}: ready={c.get('ready')} restarts={c.get('restartCount')} {c.get('state')}"
                      for c in status.get("containerStatuses") or []]
            out.append(f"Pod {m['namespace']}/{m['name']} {status.get('phase')} {status.get('podIP')} "
                       f"deleting={bool(m.get('deletionTimestamp'))} {states}")
        out += [f"Event {e['involvedObject'].get('name')}: {e.get('reason')} {e.get('message')}"
                for e in k.list("Event", all_namespaces=True) if e.get("type") == "Warning"]
        for pod in k.list("Pod", all_namespaces=True):
            m = meta(pod)
            tail = k.logs(m["name"], m["namespace"]).splitlines()[-log_lines:]
            out.append(f"--- logs of {m['namespace']}/{m['name']}:\n" + "\n".join(tail))
        return "\n".join(out + self.errors)

    def resolve(self, name: str, namespace: str = "default") -> str | None:
        """The address ``name`` has for a Pod in ``namespace`` (what its /etc/hosts
        says), for tests that reach a Service from the host."""
        k = self.kubectl
        endpoints = {(meta(e)["namespace"], meta(e)["name"]): e for e in k.list("Endpoints", all_namespaces=True)}
        probe = {"metadata": {"name": "resolver", "namespace": namespace}, "spec": {}, "status": {"podIP": "-"}}
        for line in hosts_file(probe, k.list("Service", all_namespaces=True), endpoints).splitlines():
            address, *names = line.split()
            if name in names and not line.startswith("#"):
                return address
        return None
