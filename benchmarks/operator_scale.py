"""The operator against the number of engines: a PDCluster scaled on the cluster stand-in.

On the stand-in (``tests/e2e/standin``: the API emulator, its controllers, its kubelet)
``pdserve operator``'s ``serve`` runs in a process of its own, watching one PDCluster of
simulated engines (1 prefill, 1 decode to start). Each step of ``--steps`` sets
``spec.decode.replicas`` to the next size (``101,301,101``: +100, +200, -200) and
measures, from the patch:

- created: seconds until every wanted decode PDInstance and its Pod exist (scaling
  down: until every surplus one is gone);
- ready: seconds until the PDCluster's status says so (``readyDecode`` at the new size,
  ``observedGeneration`` the new one) and every decode PDInstance reads health Ready
  (in the Controller's routable view);
- the operator process's CPU seconds from the patch to ready, and its API requests
  (reconcile's ``KubeClient`` and kopf's own) by action and kind;
- at rest: the operator's CPU (% of a core) over ``--idle-seconds`` after the step
  (resyncs and nothing else to do).

Engines do not run. The stand-in's kubelet runs each Pod as real processes (a NodeAgent
and its engine per Pod: ``simulate.perProcess`` packs engines where one NodeAgent runs
several, ``pdserve up``, not into the operator's one Pod per PDInstance), and 300 of
them do not fit two cores. So the engine pools' nodeSelector matches no node (the
kubelet leaves their Pods unscheduled) and this script plays their kubelet: it writes
each engine Pod Running and Ready (an IP, no process) as soon as it sees it, and a fake
Controller (the operator-facing gRPC calls) lists every Running engine as routable and
says every drain is done. The Controller's Deployment runs for real (the operator asks
the Controller only while its Deployment is available) but the operator talks to the
fake one; the Coordinator has no replica (it is Ready only with an engine to route to),
so the PDCluster's Ready condition stays False (WaitingForControlPlane) throughout. What is measured is the operator's and the API's share of a
scale: not an engine's start, nor the Coordinator's routing.

``--api-latency-ms MS`` delays each of reconcile's API calls by MS before it is sent
(a real apiserver answers in several milliseconds; calls in flight wait together).
``--operator-src DIR`` runs the operator from another tree (a ``git archive`` of an
older commit, for a before/after). ``--profile DIR``: py-spy records the operator
during each step (``DIR/step-<i>-<size>.txt``, summarized by ``profile_summary.py``).
Needs root (the stand-in's namespaces) and py-spy for ``--profile``.

Rerun: .venv/bin/python benchmarks/operator_scale.py --steps 101,301,101 [--api-latency-ms 5] --json op.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

NS, NAME = "serving", "scale"
NO_NODE = {"pdserve.io/operator-scale": "no-such-node"}
TICK_S = os.sysconf("SC_CLK_TCK")


def cluster_spec(num_decode: int) -> dict:
    pool = {"threads": 1, "nodeSelector": NO_NODE}
    return {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster", "metadata": {"name": NAME, "namespace": NS},
            "spec": {"model": {"preset": "small", "servedName": "sim"},
                     "engine": {"kvCacheBytes": "64Mi", "simulate": {}},
                     "prefill": {"replicas": 1, **pool}, "decode": {"replicas": num_decode, **pool},
                     # a Coordinator is Ready with an engine to route to: none runs here
                     "coordinator": {"replicas": 0}}}


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK_S


# --- the operator's process ---------------------------------------------------------------

def serve_operator(api_url: str, controller: str, latency_ms: float = 0.0) -> None:
    """``pdserve operator`` as the chart runs it, logged in to the emulator directly.
    ``latency_ms``: each of reconcile's API calls waits this long before it is sent (an
    apiserver's round trip; the calls in flight wait together, as they would)."""
    import kopf

    from pdserve.operator.cli import serve
    from pdserve.operator.controller_client import ControllerClients
    from pdserve.operator.kube import KubeClient
    from pdserve.operator.settings import OperatorSettings

    settings = OperatorSettings(namespace=NS, operator_namespace=NS, controller_address=controller,
                                metrics_port=-1, log_level="warning")
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_):
        return kopf.ConnectionInfo(server=api_url, insecure=True)

    kube = KubeClient(api_url)
    kube._http.headers["User-Agent"] = "pdserve-operator"  # counted apart from the stand-in's clients
    if latency_ms > 0:
        async def wait(_request) -> None:
            await asyncio.sleep(latency_ms / 1000)

        kube._http.event_hooks["request"].append(wait)
    asyncio.run(serve(settings, kube, ControllerClients(controller), registry=registry, with_login=False))


# --- on the stand-in's loop: the engines' kubelet, the fake Controller, reads -------------

class EnginePlayer:
    """The engine Pods' kubelet and their Controller, without processes: every engine Pod
    is written Running and Ready when first seen; the view lists every Running one."""

    def __init__(self, api) -> None:
        self.api, self.routable, self.num_marked = api, {}, 0

    async def run(self) -> None:
        from tests.e2e.standin.api import PODS, is_deleting, meta
        while True:
            routable = {}
            for pod in self.api.list(PODS, NS):
                labels = meta(pod).get("labels") or {}
                if labels.get("pdserve.io/component") != "engine" or is_deleting(pod):
                    continue
                name, status = meta(pod)["name"], pod.get("status") or {}
                # after the stand-in's scheduler wrote it unschedulable (else it would write over this)
                is_seen = any(c.get("type") == "PodScheduled" for c in status.get("conditions") or [])
                if status.get("phase") != "Running" and is_seen:
                    await self.api.patch(PODS, NS, name, {"status": self._running()}, subresource="status")
                    self.num_marked += 1
                    status = {"phase": "Running"}
                if status.get("phase") == "Running":
                    routable[name] = labels.get("pdserve.io/pool", "decode")
            self.routable = routable
            await asyncio.sleep(0.1)

    def _running(self) -> dict:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        ip = f"127.30.{self.num_marked // 250}.{self.num_marked % 250 + 1}"
        return {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "startTime": now,
                "conditions": [{"type": t, "status": "True", "lastTransitionTime": now}
                               for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]}


def fake_controller_servicer(player: EnginePlayer):
    from pdserve.api.proto import controller_pb2 as pb
    from pdserve.api.proto import controller_pb2_grpc as pb_grpc

    class FakeController(pb_grpc.ControllerServicer):
        async def GetView(self, request, context):
            now = time.time()
            return pb.ClusterView(mode="PD", instances=[
                pb.InstanceView(instance_id=i, role=role, health="READY", last_heartbeat_unix_s=now)
                for i, role in player.routable.items()])

        async def Drain(self, request, context):
            return pb.DrainResponse(is_known=True, is_drained=True)

        async def ListReplacements(self, request, context):
            return pb.ListReplacementsResponse()

        async def AckReplacement(self, request, context):
            return pb.AckReplacementResponse()

        async def ForgetCluster(self, request, context):
            return pb.ForgetClusterResponse()

    return FakeController(), pb_grpc.add_ControllerServicer_to_server


async def start_players(cluster) -> tuple[EnginePlayer, int, list]:
    import grpc

    from tests.e2e.standin.api import Api
    player = EnginePlayer(Api(cluster.emulator, cluster.api_url))
    servicer, add = fake_controller_servicer(player)
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    task = asyncio.create_task(player.run())
    return player, port, [server, task, player.api]


async def stop_players(keep: list) -> None:
    server, task, api = keep
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await server.stop(0)
    await api.close()


async def read_state(cluster) -> dict:
    """Decode instances and engine Pods (names), their health, the PDCluster's status."""
    import kmock

    from tests.e2e.standin.api import PODS, Api, meta
    api = Api(cluster.emulator, cluster.api_url)
    instances = api.list(kmock.resource("pdserve.io", "v1alpha1", "pdinstances"), NS)
    pods = [p for p in api.list(PODS, NS) if (meta(p).get("labels") or {}).get("pdserve.io/component") == "engine"]
    pdc = api.get(kmock.resource("pdserve.io", "v1alpha1", "pdclusters"), NS, NAME) or {}
    return {"instances": {meta(i)["name"]: (i.get("status") or {}).get("health") for i in instances
                          if (i.get("spec") or {}).get("pool") == "decode"},
            "pods": {meta(p)["name"] for p in pods}, "generation": meta(pdc).get("generation"),
            "status": pdc.get("status") or {}}


def is_ready(state: dict, num_decode: int) -> bool:
    status = state["status"]
    return (status.get("observedGeneration") == state["generation"] and status.get("readyDecode") == num_decode
            and len(state["instances"]) == num_decode
            and all(h == "Ready" for h in state["instances"].values()))


def count_requests(cluster, start: int) -> tuple[int, dict[str, int]]:
    """The operator's API requests since request number ``start``: (now, 'who action kind': n)."""
    requests = list(cluster.emulator._requests)
    counts: collections.Counter = collections.Counter()
    for r in requests[start:]:
        agent = (r.headers or {}).get("User-Agent", "")
        who = "reconcile" if agent == "pdserve-operator" else "kopf" if agent.startswith("kopf") else None
        if who is not None:
            kind = getattr(r.resource, "plural", None) or "discovery"
            action = getattr(r.action, "name", str(r.action)).lower()
            counts[f"{who} {action} {kind}{'/' + r.subresource if r.subresource else ''}"] += 1
    return len(requests), dict(counts.most_common())


# --- the run ------------------------------------------------------------------------------

def wait(cluster, check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = cluster.call(read_state(cluster))
        if check(state):
            return state
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not within {timeout_s:g}s; last {state['status']}")


def step(args, cluster, operator: subprocess.Popen, index: int, size: int, before: int) -> dict:
    prefix = f"{NAME}-decode-"
    wanted = {f"{prefix}{i}" for i in range(size)}
    surplus = {f"{prefix}{i}" for i in range(size, before)}
    spy = None
    if args.profile:
        out = Path(args.profile) / f"step-{index}-{size}.txt"
        spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--pid",
                                str(operator.pid), "--rate", "100", "--format", "raw", "-o", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)  # attached
    cpu0, num0 = cpu_s(operator.pid), len(cluster.emulator._requests)
    t0 = time.monotonic()
    cluster.kubectl.patch("PDCluster", NAME, {"spec": {"decode": {"replicas": size}}}, NS)
    num0 += 1  # the patch itself
    wait(cluster, lambda s: wanted <= set(s["instances"]) and wanted <= s["pods"]
         and not surplus & (set(s["instances"]) | s["pods"]), args.timeout, f"decode {before} -> {size} created")
    created_s = time.monotonic() - t0
    wait(cluster, lambda s: is_ready(s, size), args.timeout, f"decode {before} -> {size} ready")
    ready_s = time.monotonic() - t0
    cpu = cpu_s(operator.pid) - cpu0
    _, calls = count_requests(cluster, num0)
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
    idle0, t1 = cpu_s(operator.pid), time.monotonic()
    time.sleep(args.idle_seconds)
    idle_pct = 100 * (cpu_s(operator.pid) - idle0) / (time.monotonic() - t1)
    result = {"from": before, "to": size, "created_s": round(created_s, 2), "ready_s": round(ready_s, 2),
              "operator_cpu_s": round(cpu, 2), "num_requests": sum(calls.values()),
              "idle_cpu_pct": round(idle_pct, 1), "requests": calls}
    print(f"decode {before:4d} -> {size:4d}: created {created_s:6.2f} s, ready {ready_s:6.2f} s, operator CPU "
          f"{cpu:6.2f} s, {sum(calls.values()):5d} API requests; at rest {idle_pct:5.1f}% of a core", flush=True)
    print("    " + ", ".join(f"{k} {v}" for k, v in list(calls.items())[:8]), flush=True)
    return result


def run(args) -> list[dict]:
    from tests.e2e.standin import Cluster

    results = []
    with tempfile.TemporaryDirectory(prefix="operator-scale-") as tmp, Cluster(Path(tmp) / "cluster") as cluster:
        k = cluster.kubectl
        k.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        for crd in sorted((REPO / "crds").glob("*.yaml")):
            k.apply(crd)
        player, port, keep = cluster.call(start_players(cluster))
        env = {**os.environ, "PYTHONPATH": str(Path(args.operator_src).resolve())}
        log = open(Path(tmp) / "operator.log", "w")  # noqa: SIM115 - closed below
        operator = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve-operator",
                                     cluster.api_url, f"127.0.0.1:{port}", "--operator-src", args.operator_src,
                                     "--api-latency-ms", str(args.api_latency_ms)],
                                    env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            k.apply(cluster_spec(1))
            t0 = time.monotonic()
            wait(cluster, lambda s: is_ready(s, 1), 180, "the PDCluster of 1 + 1 engines Ready")
            print(f"PDCluster of 1 prefill + 1 decode Ready in {time.monotonic() - t0:.1f} s "
                  f"(its Controller started)", flush=True)
            before = 1
            for index, size in enumerate(args.steps):
                results.append(step(args, cluster, operator, index, size, before))
                before = size
        finally:
            operator.send_signal(signal.SIGTERM)
            try:
                operator.wait(20)
            except subprocess.TimeoutExpired:
                operator.kill()
                operator.wait()
            log.close()
            if operator.returncode not in (0, -signal.SIGTERM):
                print((Path(tmp) / "operator.log").read_text()[-3000:], file=sys.stderr)
            cluster.call(stop_players(keep))
        leaks = cluster.leaks(wait_s=10)
    if leaks or cluster.errors:
        print(f"stand-in: leaks {leaks}, errors {cluster.errors[:3]}", file=sys.stderr)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="101,301,101", help="decode replicas in turn (from 1)")
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    ap.add_argument("--timeout", type=float, default=180.0, help="per wait")
    ap.add_argument("--operator-src", default=str(REPO), help="the tree whose pdserve the operator runs")
    ap.add_argument("--profile", default=None, metavar="DIR")
    ap.add_argument("--api-latency-ms", type=float, default=0.0,
                    help="each of the operator's own API calls waits this long first (an apiserver's "
                         "round trip; the emulator answers in about a millisecond); kopf's are not delayed")
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve-operator", nargs=2, metavar=("API_URL", "CONTROLLER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_operator:
        sys.path.insert(0, str(Path(args.operator_src).resolve()))
        serve_operator(*args.serve_operator, args.api_latency_ms)
        return 0
    args.steps = [int(s) for s in args.steps.split(",")]
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    results = run(args)
    if args.profile:
        for index, size in enumerate(args.steps):
            print(f"\nprofile of the operator, decode -> {size}:", flush=True)
            subprocess.run([sys.executable, str(HERE / "profile_summary.py"),
                            str(Path(args.profile) / f"step-{index}-{size}.txt"), "--top", "25"], check=False)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
