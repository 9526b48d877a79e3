"""Support for the operator's end-to-end tests: the operator in a thread against the
emulator, a fake Controller, and the parts of Kubernetes the emulator lacks (kubelet,
Deployment controller, garbage collector), played on demand.
"""

from __future__ import annotations

import asyncio
import base64
import sys
import threading
import time

import attrs
import grpc
import kmock
import kopf

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.operator import builders as b
from pdserve.operator.cli import serve
from pdserve.operator.controller_client import ControllerClients
from pdserve.operator.kube import KubeClient
from pdserve.operator.metrics import OperatorMetrics
from pdserve.operator.settings import OperatorSettings
from tests.kmock_emulator import VERBS, StrictEmulator

NS = "serving"


@attrs.define(kw_only=True)
class OperatorEmulator(StrictEmulator):
    """The strict emulator plus the kinds the operator writes beyond it: Secrets (the
    cluster tokens, the operator's key) and PodDisruptionBudgets."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, kind in (("v1/secrets", "Secret"), ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget")):
            self.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=True, verbs=set(VERBS))


class FakeController(pb_grpc.ControllerServicer):
    """The operator-facing RPCs of a Controller, scripted by the test. ``routable``:
    instance id -> role, listed READY in the view (heartbeat: now); ``tokens``: the
    cluster token each call presented."""

    def __init__(self) -> None:
        self.drain_calls: list[str] = []
        self.drained: set[str] = set()
        self.replacements: dict[str, str] = {}
        self.acked: list[str] = []
        self.num_forgets = 0
        self.mode = "PD"
        self.routable: dict[str, str] = {}
        self.tokens: set[str] = set()

    def _saw(self, context) -> None:
        self.tokens.add(dict(context.invocation_metadata() or ()).get("x-pdserve-token", ""))

    async def Drain(self, request, context):
        self._saw(context)
        self.drain_calls.append(request.instance_id)
        return pb.DrainResponse(is_known=True, is_drained=request.instance_id in self.drained)

    async def ListReplacements(self, request, context):
        self._saw(context)
        return pb.ListReplacementsResponse(replacements=[
            pb.Replacement(instance_id=i, reason=r) for i, r in self.replacements.items()])

    async def AckReplacement(self, request, context):
        self.replacements.pop(request.instance_id, None)
        self.acked.append(request.instance_id)
        return pb.AckReplacementResponse()

    async def ForgetCluster(self, request, context):
        self._saw(context)
        self.num_forgets += 1
        return pb.ForgetClusterResponse(num_keys_deleted=3)

    async def GetView(self, request, context):
        self._saw(context)
        return pb.ClusterView(mode=self.mode, instances=[
            pb.InstanceView(instance_id=i, role=role, health="READY", last_heartbeat_unix_s=time.time())
            for i, role in self.routable.items()])


async def start_fake_controller() -> tuple[FakeController, grpc.aio.Server, int]:
    fake = FakeController()
    server = grpc.aio.server()
    pb_grpc.add_ControllerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return fake, server, port


def _frames(frame, limit: int) -> list:
    out = []
    while frame is not None and len(out) < limit:
        out.append(frame)
        frame = frame.f_back
    return out


def _awaiting(coro) -> list[str]:
    """The chain of coroutines ``coro`` awaits, outermost first, each as module.name:line."""
    out = []
    while coro is not None and hasattr(coro, "cr_frame") and coro.cr_frame is not None:
        frame = coro.cr_frame
        out.append(f"{frame.f_globals.get('__name__')}.{coro.__qualname__}:{frame.f_lineno}")
        coro = coro.cr_await
    return out


class OperatorThread:
    """``pdserve operator``'s ``serve`` in a thread with its own loop (kopf cancels
    every task of its loop on exit, so it must not share the test's)."""

    def __init__(self, api_url: str, settings: OperatorSettings) -> None:
        self.api_url, self.settings = api_url, settings
        self.metrics = OperatorMetrics()
        self.stop_flag, self.ready_flag = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._main, name="operator", daemon=True)
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def where(self) -> str:
        """Where the operator is now: its thread's innermost frames and what each task of
        its loop running pdserve's code awaits (for a failure message: a wait that timed
        out says what the operator was waiting on)."""
        frame = sys._current_frames().get(self.thread.ident)
        lines = ["thread: " + " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}"
                                           for f in _frames(frame, 6))]
        for task in asyncio.all_tasks(self.loop) if self.loop else ():
            chain = _awaiting(task.get_coro())
            ours = [i for i, name in enumerate(chain) if name.startswith("pdserve.")]
            if ours:  # from the first of pdserve's frames in
                lines.append(f"task {task.get_name()}: " + " -> ".join(chain[ours[0]:]))
        return "\n".join(lines)

    def _main(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            registry = kopf.OperatorRegistry()

            @kopf.on.login(registry=registry)
            def login(**_):
                return kopf.ConnectionInfo(server=self.api_url, insecure=True)

            controllers = ControllerClients(self.settings.controller_address)
            await serve(self.settings, KubeClient(self.api_url), controllers, registry=registry,
                        with_login=False, stop_flag=self.stop_flag, ready_flag=self.ready_flag,
                        metrics=self.metrics)

        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def start(self) -> None:
        self.thread.start()
        if not self.ready_flag.wait(30):
            raise TimeoutError("the operator did not start")

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the operator did not stop"
        assert self.error is None, self.error


async def eventually(check, timeout_s: float = 20.0, what: str = "condition"):
    """Await ``check()`` (sync or async) until it returns a truthy value."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def condition(cluster: dict | None, type_: str) -> str | None:
    for c in ((cluster or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c["status"]
    return None


class Kubernetes:
    """The test's view of the emulator, and the controllers it does not run."""

    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube

    async def cluster(self, name: str) -> dict | None:
        return await self.kube.get("PDCluster", NS, name)

    async def engine_pods(self, name: str) -> dict[str, dict]:
        pods = await self.kube.list("Pod", NS, {b.CLUSTER_LABEL: name, b.COMPONENT_LABEL: "engine"})
        return {p["metadata"]["name"]: p for p in pods}

    async def instances(self, name: str) -> dict[str, dict]:
        items = await self.kube.list("PDInstance", NS, {b.CLUSTER_LABEL: name})
        return {i["metadata"]["name"]: i for i in items}

    async def kubelet(self, name: str, phase: str = "Running") -> list[str]:
        """Start every engine Pod that has no phase yet; returns their names."""
        started = []
        for pod_name, pod in (await self.engine_pods(name)).items():
            if not (pod.get("status") or {}).get("phase"):
                await self.set_pod_phase(pod_name, phase)
                started.append(pod_name)
        return started

    async def set_pod_phase(self, pod: str, phase: str) -> None:
        ready = "True" if phase == "Running" else "False"
        await self.kube.patch("Pod", NS, pod, {"status": {
            "phase": phase, "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": ready}]}},
            subresource="status")

    async def deployments_available(self, name: str) -> None:
        """The Deployment controller's part (a replica available) and the EndpointSlice
        controller's (the Coordinator Service routes to it)."""
        for component in ("controller", "coordinator"):
            await self.kube.patch("Deployment", NS, f"{name}-{component}",
                                  {"status": {"availableReplicas": 1}}, subresource="status")
        routed = [{"addresses": ["10.0.0.2"], "conditions": {"ready": True}}]
        slice_name = f"{name}-coordinator-x1"
        found = await self.kube.get("EndpointSlice", NS, slice_name)
        if found is None:
            service = f"{name}-coordinator"
            await self.kube.create({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                                    "metadata": {"name": slice_name, "namespace": NS,
                                                 "labels": {b.CLUSTER_LABEL: name,
                                                            b.SERVICE_NAME_LABEL: service}},
                                    "addressType": "IPv4", "endpoints": routed,
                                    "ports": [{"name": "http", "port": 8000}]})
        elif found.get("endpoints") != routed:
            await self.kube.patch("EndpointSlice", NS, slice_name, {"endpoints": routed})

    async def garbage_collect(self) -> list[str]:
        """Delete every object whose owner is gone (one sweep per call)."""
        owners = {o["metadata"]["uid"] for kind in ("PDCluster", "PDInstance")
                  for o in await self.kube.list(kind, NS, {})}
        collected = []
        for kind in ("PDInstance", "Pod", "Deployment", "Service", "ConfigMap", "Secret",
                     "PodDisruptionBudget"):
            for obj in await self.kube.list(kind, NS, {}):
                refs = obj["metadata"].get("ownerReferences") or []
                if refs and all(r["uid"] not in owners for r in refs):
                    await self.kube.delete(kind, NS, obj["metadata"]["name"])
                    collected.append(f"{kind}/{obj['metadata']['name']}")
        return collected

    async def token(self, name: str) -> str | None:
        """The cluster token the operator wrote for ``name``."""
        secret = await self.kube.get("Secret", NS, f"{name}-token")
        return base64.b64decode(secret["data"]["token"]).decode() if secret else None

    async def events(self, name: str) -> list[tuple[str, str]]:
        response = await self.kube._http.get(f"/api/v1/namespaces/{NS}/events")
        return [(e.get("reason"), e.get("message")) for e in response.json().get("items", [])
                if (e.get("involvedObject") or {}).get("name") == name]
