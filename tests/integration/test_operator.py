"""The operator end to end: kopf's real machinery against the Kubernetes emulator.

The test plays the kubelet (Pod phases), the Deployment controller (available
replicas) and the garbage collector; a fake Controller answers drains, replacement
requests and the final forget. Each step checks objects and status conditions.
"""

from __future__ import annotations

import kmock
import pytest
import pytest_asyncio

from pdserve.operator import builders as b
from pdserve.operator.kube import KubeClient
from pdserve.operator.settings import OperatorSettings
from tests.integration.test_operator_support import (
    NS,
    Kubernetes,
    OperatorEmulator,
    OperatorThread,
    condition,
    eventually,
    start_fake_controller,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.kmock(cls=OperatorEmulator), pytest.mark.timeout(120)]


def manifest(name: str = "tiny", prefill: int = 1, decode: int = 1, **spec) -> dict:
    return {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"preset": "tiny"}, "engine": {"dtype": "float32"},
                     "prefill": {"replicas": prefill}, "decode": {"replicas": decode}, **spec}}


@pytest_asyncio.fixture(params=[""], ids=["all-namespaces"])
async def env(kmock, request):
    fake, server, port = await start_fake_controller()
    settings = OperatorSettings(namespace=request.param, resync_s=0.5, drain_deadline_s=30.0,
                                forget_deadline_s=5.0, metrics_port=-1, image="pdserve:test",
                                controller_address=f"127.0.0.1:{port}")
    url = str(kmock.url).rstrip("/")
    operator = OperatorThread(url, settings)
    operator.start()
    kube = KubeClient(url)
    try:
        yield Kubernetes(kube), fake, operator
    finally:
        operator.stop()
        await kube.close()
        await server.stop(None)


async def ready_cluster(k8s: Kubernetes, name: str, num_pods: int) -> dict:
    """Play kubelet and Deployment controller until ``name`` is Ready with ``num_pods``."""
    async def check():
        await k8s.kubelet(name)
        await k8s.deployments_available(name)
        cluster = await k8s.cluster(name)
        pods = await k8s.engine_pods(name)
        is_current = (cluster or {}).get("status", {}).get("observedGeneration") == (
            (cluster or {}).get("metadata", {}).get("generation"))
        return cluster if (is_current and condition(cluster, "Ready") == "True"
                           and len(pods) == num_pods) else None
    return await eventually(check, what=f"{name} Ready with {num_pods} Pods")


async def test_lifecycle_create_scale_roll_replace_delete(env):
    k8s, fake, operator = env

    # create: one PDInstance and one Pod per replica, control plane, Services, config
    await k8s.kube.create(manifest())
    cluster = await eventually(lambda: k8s.cluster("tiny"), what="the PDCluster")
    await eventually(lambda: _progressing(k8s, "tiny"), what="Progressing while Pods start")
    cluster = await ready_cluster(k8s, "tiny", 2)
    status = cluster["status"]
    assert status["observedGeneration"] == cluster["metadata"]["generation"]
    assert (status["readyPrefill"], status["readyDecode"], status["mode"]) == (1, 1, "PD")
    assert condition(cluster, "Progressing") == "False" and condition(cluster, "Degraded") == "False"
    assert condition(cluster, "HybridFallback") == "False"
    assert set(await k8s.instances("tiny")) == {"tiny-prefill-0", "tiny-decode-0"}
    pods = await k8s.engine_pods("tiny")
    pod = pods["tiny-decode-0"]
    assert pod["spec"]["containers"][0]["args"][:5] == [
        "nodeagent", "--controller", "tiny-controller:50050", "--instance", "tiny-decode-0=decode"]
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "PDInstance"
    for kind, name in (("ConfigMap", "tiny-config"), ("Service", "tiny-coordinator"),
                       ("Service", "tiny-engines"), ("Deployment", "tiny-controller"),
                       ("Deployment", "tiny-coordinator")):
        obj = await k8s.kube.get(kind, NS, name)
        assert obj["metadata"]["ownerReferences"][0]["uid"] == cluster["metadata"]["uid"], name
    instance = (await k8s.instances("tiny"))["tiny-decode-0"]
    [routed] = instance["status"].pop("conditions")
    assert instance["status"] == {"phase": "Running", "pod": "tiny-decode-0", "health": "Starting"}
    assert (routed["type"], routed["status"]) == ("Ready", "False")  # the fake routes to nothing

    # scale up decode 1 -> 2
    await k8s.kube.patch("PDCluster", NS, "tiny", {"spec": {"decode": {"replicas": 2}}})
    cluster = await ready_cluster(k8s, "tiny", 3)
    assert cluster["status"]["readyDecode"] == 2

    # scale down 2 -> 1: the surplus instance drains through the Controller first
    await k8s.kube.patch("PDCluster", NS, "tiny", {"spec": {"decode": {"replicas": 1}}})
    await eventually(lambda: "tiny-decode-1" in fake.drain_calls, what="a drain request")
    cluster = await eventually(lambda: _with_reason(k8s, "tiny", "Progressing", "ScalingDown"),
                               what="Progressing/ScalingDown")
    assert "tiny-decode-1" in await k8s.engine_pods("tiny")  # not deleted while draining
    assert (await k8s.instances("tiny"))["tiny-decode-1"]["status"]["phase"] == "Terminating"
    fake.drained.add("tiny-decode-1")
    await eventually(lambda: _absent(k8s, "tiny", "tiny-decode-1"), what="the drained instance deleted")
    cluster = await ready_cluster(k8s, "tiny", 2)
    assert cluster["status"]["desiredDecode"] == 1

    # spec change of engine settings: one Pod at a time, never both pools empty at once
    old_hashes = {p["metadata"]["labels"][b.SPEC_HASH_LABEL] for p in pods.values()}
    await k8s.kube.patch("PDCluster", NS, "tiny", {"spec": {"engine": {"blockSize": 32}}})
    seen: list[dict[str, tuple[str, str | None]]] = []  # name -> (settings hash, phase)

    async def rolled():
        pods = await k8s.engine_pods("tiny")
        seen.append({n: (p["metadata"]["labels"][b.SPEC_HASH_LABEL], (p.get("status") or {}).get("phase"))
                     for n, p in pods.items()})
        await k8s.kubelet("tiny")
        return len(pods) == 2 and not old_hashes & {h for h, _ in seen[-1].values()}
    await eventually(rolled, what="Pods with the new engine settings")
    assert all(any(phase == "Running" for _, phase in pods.values()) for pods in seen), \
        f"no engine Pod ran at some point of the roll: {seen}"
    assert any(len({h for h, _ in pods.values()}) == 2 for pods in seen), "the roll was not progressive"
    cluster = await ready_cluster(k8s, "tiny", 2)
    assert cluster["status"]["observedGeneration"] == cluster["metadata"]["generation"]
    config = await k8s.kube.get("ConfigMap", NS, "tiny-config")
    assert "blockSize: 32" in config["data"]["cluster.yaml"]
    # each pool's engines read their own immutable file; the old settings' files are gone
    engine_files = await k8s.kube.list("ConfigMap", NS, {b.CLUSTER_LABEL: "tiny",
                                                         b.COMPONENT_LABEL: "engine-config"})
    mounted = {v["configMap"]["name"] for p in (await k8s.engine_pods("tiny")).values()
               for v in p["spec"]["volumes"] if "configMap" in v}
    assert {c["metadata"]["name"] for c in engine_files} == mounted and len(mounted) == 2
    assert all("blockSize: 32" in c["data"]["cluster.yaml"] for c in engine_files)
    budgets = await k8s.kube.list("PodDisruptionBudget", NS, {b.CLUSTER_LABEL: "tiny"})
    assert {p["metadata"]["name"] for p in budgets} == {"tiny-prefill", "tiny-decode"}

    # the Controller asks for a replacement: the Pod is deleted and recreated
    uid = (await k8s.engine_pods("tiny"))["tiny-prefill-0"]["metadata"]["uid"]
    fake.replacements["tiny-prefill-0"] = "3 failures within 600s"
    await eventually(lambda: "tiny-prefill-0" in fake.acked, what="the replacement acknowledged")
    pods = await eventually(lambda: _pods_if(k8s, "tiny", lambda p: "tiny-prefill-0" in p),
                            what="the Pod recreated")
    assert pods["tiny-prefill-0"]["metadata"]["uid"] != uid
    await ready_cluster(k8s, "tiny", 2)
    # Events are written after the change they report: wait for the last one to land.
    wanted = {"CreatedInstance", "Draining", "DeletedInstance", "RollingEngines", "ReplacingInstance"}

    async def reported():
        return wanted <= {r for r, _ in await k8s.events("tiny")}
    await eventually(reported, what=f"the Events {sorted(wanted)}")

    # the Controller reports fallback: HybridFallback follows its view
    fake.mode = "FALLBACK"
    cluster = await eventually(lambda: _with_reason(k8s, "tiny", "HybridFallback", "ControllerFallback"),
                               what="HybridFallback True")
    assert condition(cluster, "HybridFallback") == "True" and cluster["status"]["mode"] == "Fallback"
    fake.mode = "PD"

    # delete: engines go, the Controller forgets, the finalizer is removed; the GC does the rest
    await k8s.kube.delete("PDCluster", NS, "tiny")
    await _until_gone(k8s, fake, operator, "tiny")
    assert fake.num_forgets >= 1  # idempotent; kopf may repeat the handler once
    assert not await k8s.engine_pods("tiny") and not await k8s.instances("tiny")
    await k8s.garbage_collect()
    for kind in ("Deployment", "Service", "ConfigMap"):
        assert not await k8s.kube.list(kind, NS, {b.CLUSTER_LABEL: "tiny"}), kind
    assert operator.metrics.value("pdserve_operator_reconciles_total", trigger="resync", result="ok") > 0
    assert operator.metrics.value("pdserve_operator_errors_total", kind="api") == 0


async def test_invalid_spec_is_reported_and_fixed_by_an_update(env):
    k8s, fake, operator = env
    await k8s.kube.create(manifest("bad", prefill=0, decode=0))
    cluster = await eventually(lambda: _with_reason(k8s, "bad", "Degraded", "InvalidSpec"),
                               what="Degraded/InvalidSpec")
    message = next(c["message"] for c in cluster["status"]["conditions"] if c["type"] == "Ready")
    assert "spec.prefill.replicas, spec.decode.replicas or spec.hybrid.replicas must be greater than 0" \
        in message
    assert not await k8s.instances("bad")
    assert operator.metrics.value("pdserve_operator_errors_total", kind="invalid") >= 1
    await k8s.kube.patch("PDCluster", NS, "bad", {"spec": {"decode": {"replicas": 1}}})
    cluster = await ready_cluster(k8s, "bad", 1)
    assert condition(cluster, "Degraded") == "False"
    # a Pod that fails is recreated and the cluster reports Degraded meanwhile
    await k8s.set_pod_phase("bad-decode-0", "Failed")
    await eventually(lambda: _pods_if(k8s, "bad", lambda p: "bad-decode-0" in p and not
                                      (p["bad-decode-0"].get("status") or {}).get("phase")),
                     what="the failed Pod recreated")
    await ready_cluster(k8s, "bad", 1)


async def test_control_plane_settings_roll_their_deployments_and_no_engine(env):
    """Routing, SLO, fallback and heartbeat thresholds reach the Coordinator and the
    Controller (their pod templates change) while every engine Pod keeps running."""
    k8s, fake, operator = env
    await k8s.kube.create(manifest())
    await ready_cluster(k8s, "tiny", 2)
    uids = {n: p["metadata"]["uid"] for n, p in (await k8s.engine_pods("tiny")).items()}
    controller = await k8s.kube.get("Deployment", NS, "tiny-controller")
    hash_before = controller["spec"]["template"]["metadata"]["annotations"][b.CONFIG_HASH_ANNOTATION]
    await k8s.kube.patch("PDCluster", NS, "tiny", {"spec": {
        "routing": {"prefillPolicy": "round_robin"}, "slo": {"ttftMs": 700},
        "fallback": {"policy": "queue"}, "heartbeat": {"suspectAfterMissed": 4}}})

    async def applied():
        coordinator = await k8s.kube.get("Deployment", NS, "tiny-coordinator")
        controller = await k8s.kube.get("Deployment", NS, "tiny-controller")
        args = coordinator["spec"]["template"]["spec"]["containers"][0]["args"]
        annotation = controller["spec"]["template"]["metadata"]["annotations"][b.CONFIG_HASH_ANNOTATION]
        return (args[args.index("--prefill-policy") + 1] == "round_robin" and "--ttft-slo-s" in args
                and annotation != hash_before)
    await eventually(applied, what="the Coordinator and Controller templates updated")
    cluster = await ready_cluster(k8s, "tiny", 2)
    assert {n: p["metadata"]["uid"] for n, p in (await k8s.engine_pods("tiny")).items()} == uids
    assert "RollingEngines" not in {r for r, _ in await k8s.events("tiny")}
    assert condition(cluster, "Progressing") == "False"


async def test_instance_health_role_and_heartbeat_follow_the_controller(env):
    """PDInstance status says what the Controller's view says: Ready with the role it
    runs and its last heartbeat; an instance that leaves the view is Suspect and the
    cluster Degraded/InstanceUnhealthy. Every call carries the cluster's own token."""
    k8s, fake, operator = env
    await k8s.kube.create(manifest())
    await ready_cluster(k8s, "tiny", 2)
    fake.routable = {"tiny-prefill-0": "prefill", "tiny-decode-0": "decode"}

    async def statuses(want: dict[str, tuple[str, str]]):
        got = {n: ((i.get("status") or {}).get("health"), (i.get("status") or {}).get("role"))
               for n, i in (await k8s.instances("tiny")).items()}
        return got if got == want else None
    await eventually(lambda: statuses({"tiny-prefill-0": ("Ready", "prefill"),
                                       "tiny-decode-0": ("Ready", "decode")}), what="Ready instances")
    instance = (await k8s.instances("tiny"))["tiny-decode-0"]
    assert instance["status"]["lastHeartbeat"].endswith("Z")
    fake.routable["tiny-prefill-0"] = "decode"  # the Controller switched its role
    await eventually(lambda: statuses({"tiny-prefill-0": ("Ready", "decode"),
                                       "tiny-decode-0": ("Ready", "decode")}), what="the role switch")
    del fake.routable["tiny-decode-0"]  # out of the routable view: heartbeats missed
    await eventually(lambda: statuses({"tiny-prefill-0": ("Ready", "decode"),
                                       "tiny-decode-0": ("Suspect", "decode")}), what="a Suspect instance")
    cluster = await eventually(lambda: _with_reason(k8s, "tiny", "Degraded", "InstanceUnhealthy"),
                               what="Degraded/InstanceUnhealthy")
    assert "tiny-decode-0" in next(c["message"] for c in cluster["status"]["conditions"]
                                   if c["type"] == "Degraded")
    assert cluster["status"]["readyDecode"] == 0
    fake.routable["tiny-decode-0"] = "decode"
    await eventually(lambda: _with_reason(k8s, "tiny", "Degraded", "AsExpected"), what="healthy again")
    token = await k8s.token("tiny")
    assert token and len(token) == 64 and fake.tokens == {token}


@pytest.mark.parametrize("env", [NS], ids=["one-namespace"], indirect=True)
async def test_watching_one_namespace(env):
    """The namespaced RBAC mode: kopf watches one namespace and scans no cluster-wide
    resource; the cluster still comes up and goes."""
    k8s, fake, operator = env
    await k8s.kube.create(manifest())
    await ready_cluster(k8s, "tiny", 2)
    await k8s.kube.delete("PDCluster", NS, "tiny")
    await _until_gone(k8s, fake, operator, "tiny")
    assert await k8s.token("tiny") is None  # the finalizer deleted the token Secret


async def _progressing(k8s, name):
    cluster = await k8s.cluster(name)
    return cluster if condition(cluster, "Progressing") == "True" else None


async def _with_reason(k8s, name, type_, reason):
    cluster = await k8s.cluster(name)
    for c in ((cluster or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_ and c["reason"] == reason:
            return cluster
    return None


async def _absent(k8s, name, instance):
    return instance not in await k8s.instances(name) and instance not in await k8s.engine_pods(name)


async def _gone(k8s, name):
    return await k8s.cluster(name) is None


async def _until_gone(k8s, fake, operator, name: str) -> None:
    """The deleted PDCluster ``name`` disappears (its finalizer removed); on a timeout
    the failure says where the deletion stopped and what the operator awaits."""
    try:
        await eventually(lambda: _gone(k8s, name), timeout_s=45.0, what=f"the PDCluster {name} gone")
    except AssertionError as exc:
        meta = ((await k8s.cluster(name)) or {}).get("metadata", {})
        raise AssertionError(f"{exc}: finalizers {meta.get('finalizers')}, deletionTimestamp "
                             f"{meta.get('deletionTimestamp')}, engine Pods {sorted(await k8s.engine_pods(name))}, "
                             f"Controller forgets {fake.num_forgets}; the operator:\n{operator.where()}") from None


async def _pods_if(k8s, name, predicate):
    pods = await k8s.engine_pods(name)
    return pods if predicate(pods) else None


assert kmock.__version__ == "0.8", "the emulator subclass is written against kmock 0.8"
