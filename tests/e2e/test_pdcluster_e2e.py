"""The pdserve operator end to end on the cluster stand-in: from ``helm template`` and
``kubectl apply -f examples/minimal.yaml`` to a completion through the Coordinator
Service, with every component a real process in its own Pod.

What runs: the chart's objects (operator Deployment, its ServiceAccount, RBAC,
Service; chart values: an external etcd, since the chart's etcd is a Go binary whose
sockets the stand-in cannot place on a Pod address), the operator Pod logging in with
its service account over TLS through the ``kubernetes`` Service as kopf does in a
cluster; the CRDs from crds/; then what the operator builds for examples/minimal.yaml
(Controller and Coordinator Deployments, one NodeAgent Pod per PDInstance launching
its engine, Services, ConfigMaps). The test reads what a user reads: conditions, Pods,
PDInstances, and the answer of ``POST /v1/completions`` sent to the Coordinator by
its Service name from a client Pod (and from the host, at the address the name
resolves to); then it scales decode up and down (the drain goes through the real
Controller), deletes an engine Pod (recreated, Ready again, serving), and deletes the
PDCluster, which must leave nothing behind.

A failure here that is not the stand-in's is a finding about pdserve on Kubernetes:
every wait says what it waited for and dumps the Pods, warnings and logs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request

import pytest
import yaml

from tests.e2e.standin import condition_status, wait_for
from tests.etcd import free_port
from tests.kube_tools import tool_path
from tests.procs import REPO, Proc

pytestmark = pytest.mark.timeout(240)

SYSTEM, SERVING = "pdserve-system", "serving"
CLUSTER_LABEL = "pdserve.io/cluster"
COMPLETION = """
import json, sys, urllib.request
body = json.dumps({"model": "tiny", "prompt": "Hello, Kubernetes", "max_tokens": 8,
                   "ignore_eos": True}).encode()
request = urllib.request.Request(sys.argv[1], body, {"Content-Type": "application/json"})
print(urllib.request.urlopen(request, timeout=60).read().decode())
"""


@pytest.fixture
def etcd(cluster, tmp_path):
    """An etcd outside the Pods, on the node's address (as an external etcd would be)."""
    if shutil.which("etcd") is None:
        pytest.fail("etcd is not installed: `make test` installs the Debian package etcd-server")
    host = cluster.node_ip
    client, peer = f"http://{host}:{free_port(host)}", f"http://{host}:{free_port(host)}"
    proc = Proc(["etcd", "--name", "e2e", "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls", client,
                 "--advertise-client-urls", client, "--listen-peer-urls", peer,
                 "--initial-advertise-peer-urls", peer, "--initial-cluster", f"e2e={peer}"])
    try:
        proc.wait_for("ready to serve client requests", timeout_s=30)
        yield client
    finally:
        proc.stop()


@pytest.fixture
def chart(etcd, tmp_path) -> list[dict]:
    """``helm template`` of charts/pdserve for the stand-in (external etcd)."""
    helm = tool_path("helm")
    if helm is None:
        pytest.fail("helm is not installed: `make k8s-tools` puts it into .venv/bin")
    home = tmp_path / "helm"
    out = subprocess.run([str(helm), "template", "r", str(REPO / "charts" / "pdserve"), "--namespace", SYSTEM,
                          "--set", "etcd.enabled=false", "--set", f"etcd.endpoints={{{etcd}}}"],
                         capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "HELM_CACHE_HOME": str(home / "cache"),
                              "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data"),
                              "KUBECONFIG": str(home / "no-kubeconfig")}).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def until(cluster, check, timeout_s: float, what: str):
    """``wait_for`` that adds the cluster's Pods, warnings and logs to a timeout."""
    try:
        return wait_for(check, timeout_s, what, interval_s=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.diagnostics()}") from None


def install(cluster, chart: list[dict]) -> str:
    """Namespaces, the CRDs and the chart's operator, Available; returns its Deployment's name."""
    k = cluster.kubectl
    for namespace in (SYSTEM, SERVING):
        k.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    for crd in sorted((REPO / "crds").glob("*.yaml")):
        k.apply(crd)
    k.apply(chart, namespace=SYSTEM)
    [operator] = [d["metadata"]["name"] for d in chart if d["kind"] == "Deployment"]
    until(cluster, lambda: (k.get("Deployment", operator, SYSTEM).get("status") or {}).get("availableReplicas"),
          60, "the operator Deployment available")
    return operator


def start_client(cluster) -> None:
    """A Pod named ``client`` in the serving namespace to ask the Coordinator from
    (``kubectl exec client -- python3 -c ...``), Running when this returns."""
    k = cluster.kubectl
    k.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "client", "namespace": SERVING},
             "spec": {"containers": [{"name": "client", "image": "python", "command": ["sleep", "600"]}],
                      "terminationGracePeriodSeconds": 1}})
    until(cluster, lambda: (k.get("Pod", "client", SERVING).get("status") or {}).get("phase") == "Running",
          30, "the client Pod")


def test_minimal_pdcluster_becomes_ready_serves_a_completion_and_is_deleted(cluster, chart):
    k = cluster.kubectl
    operator = install(cluster, chart)

    # kubectl apply -f examples/minimal.yaml: Ready with every Pod a running process
    k.apply(REPO / "examples" / "minimal.yaml", namespace=SERVING)

    def ready():
        pdc = k.get("PDCluster", "tiny", SERVING) or {}
        status = pdc.get("status") or {}
        return pdc if (condition_status(pdc, "Ready") == "True"
                       and status.get("observedGeneration") == pdc["metadata"]["generation"]) else None

    pdc = until(cluster, ready, 150, "PDCluster tiny Ready")
    status = pdc["status"]
    assert (status["readyPrefill"], status["readyDecode"], status["mode"]) == (1, 1, "PD"), status
    assert condition_status(pdc, "Degraded") == "False" and condition_status(pdc, "Progressing") == "False"
    pods = {p["metadata"]["name"]: p for p in k.list("Pod", SERVING, labels={CLUSTER_LABEL: "tiny"})}
    components = sorted(p["metadata"]["labels"]["pdserve.io/component"] for p in pods.values())
    assert components == ["controller", "coordinator", "engine", "engine"], sorted(pods)
    for name, p in pods.items():
        assert p["status"]["phase"] == "Running" and condition_status(p, "Ready") == "True", name
        assert p["status"]["podIP"].startswith("127.10."), name
    instances = {i["metadata"]["name"]: i for i in k.list("PDInstance", SERVING)}
    assert sorted(instances) == ["tiny-decode-0", "tiny-prefill-0"]
    assert all(i["status"]["phase"] == "Running" for i in instances.values()), instances
    # kubectl get pdi: each instance's health and role as the Controller sees them
    until(cluster, lambda: all((i.get("status") or {}).get("health") == "Ready"
                               and i["status"].get("role") == i["spec"]["role"]
                               for i in k.list("PDInstance", SERVING)), 30, "every PDInstance healthy")
    # each NodeAgent Pod supervises its engine: two processes in the Pod's own PID namespace
    code, processes = k.exec("tiny-decode-0", ["ps", "-eo", "pid,args"], SERVING)
    assert code == 0 and "nodeagent" in processes.splitlines()[1] and " engine " in processes, processes

    # one completion through the Coordinator's Service name, from a Pod
    start_client(cluster)
    url = status["coordinatorUrl"].rstrip("/") + "/v1/completions"
    assert url.startswith("http://tiny-coordinator.serving.svc:8000"), url
    code, out = k.exec("client", ["python3", "-c", COMPLETION, url], SERVING, timeout_s=90)
    assert code == 0, f"{out}\n{cluster.diagnostics()}"
    answer = json.loads(out)
    assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == 8, answer
    # and from outside the Pods, at the address the Service name resolves to
    address = cluster.resolve("tiny-coordinator.serving.svc")
    assert address == k.get("Service", "tiny-coordinator", SERVING)["spec"]["clusterIP"]
    out = subprocess.run([sys.executable, "-c", COMPLETION, f"http://{address}:8000/v1/completions"],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0 and json.loads(out.stdout)["choices"][0]["text"], out.stderr
    # the legs rode the engines' session ports, Pod to Pod
    with urllib.request.urlopen(f"http://{address}:8000/ready?verbose=1", timeout=10) as r:
        sessions = json.load(r)["sessions"]
    assert sessions and set(sessions.values()) == {"frames"}, sessions

    # kubectl scale: a second decode engine joins; scaled back, it drains through the Controller first
    k.patch("PDCluster", "tiny", {"spec": {"decode": {"replicas": 2}}}, SERVING)
    until(cluster, lambda: (ready() or {}).get("status", {}).get("readyDecode") == 2, 120, "two decode engines")
    k.patch("PDCluster", "tiny", {"spec": {"decode": {"replicas": 1}}}, SERVING)
    until(cluster, lambda: ready() and "tiny-decode-1" not in {i["metadata"]["name"] for i in
                                                               k.list("PDInstance", SERVING)}, 120,
          "tiny-decode-1 drained and deleted")

    def reasons() -> set:
        return {e.get("reason") for e in k.list("Event", SERVING) if e["involvedObject"].get("name") == "tiny"}
    # the operator posts a reconcile's Events after its changes, so they may trail the deletion a little
    until(cluster, lambda: "DeletedInstance" in reasons(), 30, "the DeletedInstance Event")
    assert {"Draining", "DeletedInstance"} <= reasons(), reasons()

    # an engine Pod deleted (drained node, eviction): terminated gracefully, recreated, Ready again
    uid = k.get("Pod", "tiny-decode-0", SERVING)["metadata"]["uid"]
    assert k.delete("Pod", "tiny-decode-0", SERVING)
    until(cluster, lambda: (k.get("Pod", "tiny-decode-0", SERVING) or {"metadata": {"uid": uid}})["metadata"]["uid"]
          != uid, 60, "a new tiny-decode-0 Pod")
    until(cluster, ready, 90, "PDCluster tiny Ready again")
    code, out = k.exec("client", ["python3", "-c", COMPLETION, url], SERVING, timeout_s=90)
    assert code == 0 and json.loads(out)["choices"][0]["text"], f"{out}\n{cluster.diagnostics()}"

    # kubectl delete pdc tiny: the finalizer runs, the garbage collector takes the rest
    assert k.delete("PDCluster", "tiny", SERVING)
    until(cluster, lambda: k.get("PDCluster", "tiny", SERVING) is None, 90, "PDCluster tiny gone")
    for kind in ("Pod", "PDInstance", "Deployment", "Service", "ConfigMap", "Secret", "PodDisruptionBudget"):
        until(cluster, lambda kind=kind: not k.list(kind, SERVING, labels={CLUSTER_LABEL: "tiny"}), 60,
              f"every {kind} of tiny gone")
    left = [p["metadata"]["name"] for p in k.list("Pod", SERVING)]
    assert left == ["client"], left
    # the operator never failed on the API (an object or verb the cluster refused)
    operator_pod = next(p for p in k.list("Pod", SYSTEM) if p["metadata"]["name"].startswith(operator))
    metrics = urllib.request.urlopen(f"http://{operator_pod['status']['podIP']}:8080/metrics", timeout=5).read()
    api_errors = [line for line in metrics.decode().splitlines()
                  if line.startswith("pdserve_operator_errors_total") and 'kind="api"' in line]
    assert all(line.endswith(" 0.0") for line in api_errors), api_errors


def test_a_cluster_name_too_long_for_its_objects_is_reported(cluster, chart):
    """A PDCluster name the CRD accepts (up to 63 characters) but whose objects a real
    apiserver refuses (Service names, label values and Pod hostnames: at most 63
    characters): the status must say so, rather than the operator retrying unseen."""
    k = cluster.kubectl
    install(cluster, chart)
    name = "a" * 55
    k.apply({**yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text()),
             "metadata": {"name": name, "namespace": SERVING}})

    def reported():
        pdc = k.get("PDCluster", name, SERVING) or {}
        conditions = (pdc.get("status") or {}).get("conditions") or []
        return [c for c in conditions if c["type"] in ("Ready", "Degraded") and "63" in c.get("message", "")]

    until(cluster, reported, 25, "a condition saying the name is too long for its objects")
