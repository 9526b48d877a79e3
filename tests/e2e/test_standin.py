"""The cluster stand-in itself: each behaviour the end-to-end tests rely on, checked
the way a user of a real cluster would see it (objects, status, logs, exec).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest
import yaml

from tests.e2e.standin import KubectlError, condition_status, wait_for
from tests.kube_tools import tool_path

pytestmark = pytest.mark.timeout(120)

# a tiny HTTP server: GET /ready answers 200 once /srv/ready exists; /whoami the Pod's name
SERVER = """
import http.server, os, socket
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path != "/ready" or os.path.exists("/srv/ready")
        body = (os.environ.get("POD_NAME", "") + " " + socket.gethostname()).encode()
        self.send_response(200 if ok else 503); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""
POD_NAME_ENV = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}


def pod(name: str, command: list[str], labels: dict | None = None, **spec) -> dict:
    container = {"name": "main", "image": "pdserve:test", "command": command}
    container.update(spec.pop("container", {}))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"containers": [container], "terminationGracePeriodSeconds": 2, **spec}}


def server_pod(name: str, labels: dict | None = None, **container) -> dict:
    return pod(name, ["python3", "-c", SERVER], labels, volumes=[{"name": "srv", "emptyDir": {}}], container={
        "env": [POD_NAME_ENV], "ports": [{"name": "http", "containerPort": 8080}],
        "volumeMounts": [{"name": "srv", "mountPath": "/srv"}], **container})


def first_container(p: dict) -> dict:
    """status.containerStatuses[0], or {} before the kubelet wrote any."""
    return ((p.get("status") or {}).get("containerStatuses") or [{}])[0]


def phase(k, name: str) -> str | None:
    return ((k.get("Pod", name) or {}).get("status") or {}).get("phase")


def running(k, name: str, timeout_s: float = 30) -> dict:
    return k.wait("Pod", name, lambda p: (p.get("status") or {}).get("phase") == "Running", timeout_s=timeout_s)


def test_pod_runs_its_command_with_env_and_field_refs(cluster):
    k = cluster.kubectl
    show = ("import os, socket, sys, time; print(*sys.argv[1:], os.environ['MY_NAME'], os.environ['MY_NS'],"
            " socket.gethostname(), flush=True); time.sleep(60)")
    k.apply(pod("env-demo", ["python3", "-c", show], container={
        "args": ["ip=$(MY_IP)", "greeting=$(GREETING)", "$$(KEPT)", "$(UNDEFINED)"],
        "env": [{"name": "GREETING", "value": "hi-$(MY_NAME)"},
                {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "MY_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "MY_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]}))
    status = running(k, "env-demo")["status"]
    ip = status["podIP"]
    assert ip.startswith("127.10.") and ip != status["hostIP"]
    log = wait_for(lambda: k.logs("env-demo"), 10, "the Pod's output")
    # $(VAR) expands only names defined before it (GREETING precedes MY_NAME); $$ escapes
    assert log == f"ip={ip} greeting=hi-$(MY_NAME) $(KEPT) $(UNDEFINED) env-demo default env-demo\n"
    # the Pod's own address is what it binds and reaches as "localhost"
    code, out = k.exec("env-demo", ["python3", "-c", "import socket; s = socket.socket(); s.bind(('0.0.0.0', 0));"
                                    "print(s.getsockname()[0], socket.gethostbyname('env-demo'))"])
    assert (code, out.split()) == (0, [ip, ip])
    assert k.get("Pod", "env-demo")["status"]["containerStatuses"][0]["restartCount"] == 0


def test_volumes_appear_at_their_mount_paths_inside_the_pod_only(cluster, tmp_path):
    k = cluster.kubectl
    k.apply([{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "conf"},
              "data": {"cluster.yaml": "replicas: 1\n", "other": "x"}},
             {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"},
              "stringData": {"token": "s3cr3t"}},
             {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
              "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}}])
    (cluster.pvc_dir("default", "models") / "config.json").write_text('{"model": "tiny"}')
    k.apply(pod("volumes", ["sleep", "60"], volumes=[
        {"name": "conf", "configMap": {"name": "conf", "items": [{"key": "cluster.yaml", "path": "cluster.yaml"}]}},
        {"name": "creds", "secret": {"secretName": "creds"}},
        {"name": "scratch", "emptyDir": {}},
        {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}],
        container={"volumeMounts": [
            {"name": "conf", "mountPath": "/etc/pdserve-standin", "readOnly": True},
            {"name": "creds", "mountPath": "/var/run/secrets/standin"},
            {"name": "scratch", "mountPath": "/scratch"},
            {"name": "models", "mountPath": "/models-standin", "readOnly": True}]}))
    running(k, "volumes")
    code, out = k.exec("volumes", ["sh", "-c", "cat /etc/pdserve-standin/cluster.yaml; ls /etc/pdserve-standin;"
                                   " cat /var/run/secrets/standin/token; echo;"
                                   " cat /models-standin/config.json; echo; echo data > /scratch/f && cat /scratch/f;"
                                   " touch /models-standin/x 2>/dev/null || echo read-only;"
                                   " cat /var/run/secrets/kubernetes.io/serviceaccount/namespace"])
    assert code == 0, out
    assert out.split("\n") == ["replicas: 1", "cluster.yaml", "s3cr3t", '{"model": "tiny"}', "data", "read-only",
                               "default"]
    for host_path in ("/etc/pdserve-standin", "/models-standin", "/scratch", "/var/run/secrets/standin"):
        assert not __import__("os").path.exists(host_path), f"{host_path} leaked onto the host"
    # a changed ConfigMap reaches the running Pod (the kubelet re-projects it)
    k.patch("ConfigMap", "conf", {"data": {"cluster.yaml": "replicas: 2\n"}})
    wait_for(lambda: k.exec("volumes", ["cat", "/etc/pdserve-standin/cluster.yaml"])[1] == "replicas: 2\n", 10,
             "the ConfigMap update inside the Pod")


def test_a_pod_waits_for_a_missing_configmap_and_starts_when_it_appears(cluster):
    k = cluster.kubectl
    k.apply(pod("waiting", ["sleep", "60"], volumes=[{"name": "c", "configMap": {"name": "later"}}],
                container={"volumeMounts": [{"name": "c", "mountPath": "/c"}]}))
    waiting = k.wait("Pod", "waiting", first_container)
    time.sleep(1)
    state = k.get("Pod", "waiting")["status"]["containerStatuses"][0]["state"]
    assert phase(k, "waiting") == "Pending" and "later" in state["waiting"]["message"], waiting
    k.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "later"}, "data": {"a": "1"}})
    running(k, "waiting", 10)


def test_readiness_probes_flip_ready_and_pods_share_a_port(cluster):
    k = cluster.kubectl
    k.apply(server_pod("web", readinessProbe={"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1}))
    k.apply(server_pod("web2", readinessProbe={"tcpSocket": {"port": 8080}, "periodSeconds": 1}))
    k.wait("Pod", "web2", condition="Ready", timeout_s=30)  # same port 8080: no collision
    running(k, "web")
    time.sleep(2.5)
    web = k.get("Pod", "web")
    assert condition_status(web, "Ready") == "False" and not web["status"]["containerStatuses"][0]["ready"]
    assert k.exec("web", ["touch", "/srv/ready"])[0] == 0
    web = k.wait("Pod", "web", condition="Ready", timeout_s=10)
    assert condition_status(web, "ContainersReady") == "True"
    url = f"http://{web['status']['podIP']}:8080/whoami"
    assert urllib.request.urlopen(url, timeout=5).read().decode() == "web web"
    assert k.exec("web", ["rm", "/srv/ready"])[0] == 0
    k.wait("Pod", "web", lambda p: condition_status(p, "Ready") == "False", timeout_s=10)


def test_a_startup_probe_holds_liveness_and_readiness_until_it_passes(cluster):
    k = cluster.kubectl
    k.apply(server_pod("slow", startupProbe={"exec": {"command": ["test", "-f", "/srv/started"]}, "periodSeconds": 1,
                                            "failureThreshold": 30},
                       livenessProbe={"httpGet": {"path": "/missing-until-started", "port": "http"},
                                      "periodSeconds": 1, "failureThreshold": 1},
                       readinessProbe={"tcpSocket": {"port": "http"}, "periodSeconds": 1}))
    running(k, "slow")
    time.sleep(3)  # the server listens, but neither readiness nor liveness run yet
    status = first_container(k.get("Pod", "slow"))
    assert (status["started"], status["ready"], status["restartCount"]) == (False, False, 0), status
    assert k.exec("slow", ["touch", "/srv/started"])[0] == 0
    pod = k.wait("Pod", "slow", condition="Ready", timeout_s=10)
    assert first_container(pod)["started"] and first_container(pod)["restartCount"] == 0


def test_a_pod_asking_for_what_the_node_lacks_stays_unschedulable(cluster):
    k = cluster.kubectl
    k.apply(pod("gpu", ["sleep", "60"], container={"resources": {"limits": {"nvidia.com/gpu": "1"}}}))
    k.apply(pod("elsewhere", ["sleep", "60"], nodeSelector={"pool": "gpu"}))
    for name, why in (("gpu", "Insufficient nvidia.com/gpu"), ("elsewhere", "didn't match")):
        pending = k.wait("Pod", name, lambda p: condition_status(p, "PodScheduled") == "False", timeout_s=10)
        scheduled = next(c for c in pending["status"]["conditions"] if c["type"] == "PodScheduled")
        assert scheduled["reason"] == "Unschedulable" and why in scheduled["message"], scheduled
        assert not pending["spec"].get("nodeName") and pending["status"]["phase"] == "Pending"


def test_liveness_failure_restarts_per_restart_policy(cluster):
    k = cluster.kubectl
    liveness = {"exec": {"command": ["test", "-f", "/tmp/alive"]}, "periodSeconds": 1, "failureThreshold": 2}
    command = ["sh", "-c", "touch /tmp/alive; echo started; trap 'exit 0' TERM; sleep 60 & wait"]
    for name, policy in (("always", "Always"), ("never", "Never")):
        k.apply(pod(name, command, restartPolicy=policy, container={"livenessProbe": liveness}))
    for name in ("always", "never"):
        wait_for(lambda name=name: k.exec(name, ["test", "-f", "/tmp/alive"])[0] == 0, 20, f"{name} to start")
        assert k.exec(name, ["rm", "/tmp/alive"])[0] == 0
    restarted = k.wait("Pod", "always", lambda p: first_container(p).get("restartCount") == 1
                       and "running" in first_container(p)["state"], timeout_s=20)
    status = restarted["status"]["containerStatuses"][0]
    assert status["lastState"]["terminated"]["exitCode"] == 0  # its TERM trap ran
    assert restarted["status"]["phase"] == "Running"
    assert k.logs("always", previous=True).strip() == "started"
    assert k.exec("always", ["test", "-f", "/tmp/alive"])[0] == 0  # a fresh /tmp: the new run made it
    never = k.wait("Pod", "never", lambda p: phase(k, "never") in ("Succeeded", "Failed"), timeout_s=20)
    assert never["status"]["phase"] == "Succeeded"  # exit 0 after SIGTERM, and no restart
    assert never["status"]["containerStatuses"][0]["restartCount"] == 0
    reasons = {e["reason"] for e in k.list("Event") if e["involvedObject"]["name"] == "always"}
    assert {"Scheduled", "Started", "Unhealthy"} <= reasons


def test_a_crashing_container_backs_off_and_on_failure_stops_after_success(cluster):
    k = cluster.kubectl
    k.apply(pod("crash", ["sh", "-c", "exit 3"]))
    k.apply(pod("once", ["sh", "-c", "test -f /srv/done && exit 0; touch /srv/done; exit 1"],
                restartPolicy="OnFailure", volumes=[{"name": "srv", "emptyDir": {}}],
                container={"volumeMounts": [{"name": "srv", "mountPath": "/srv"}]}))
    crash = k.wait("Pod", "crash", lambda p: first_container(p).get("restartCount", 0) >= 1
                   and "waiting" in first_container(p)["state"], timeout_s=20)
    status = crash["status"]["containerStatuses"][0]
    assert status["state"]["waiting"]["reason"] == "CrashLoopBackOff"  # 10 s before the next try
    assert status["lastState"]["terminated"]["exitCode"] == 3 and crash["status"]["phase"] == "Running"
    once = k.wait("Pod", "once", lambda p: phase(k, "once") == "Succeeded", timeout_s=20)
    assert once["status"]["containerStatuses"][0]["restartCount"] == 1


def test_service_names_resolve_inside_pods_and_route_to_ready_endpoints(cluster):
    k = cluster.kubectl
    k.apply(server_pod("backend", {"app": "web"}, readinessProbe={"httpGet": {"path": "/", "port": 8080},
                                                                  "periodSeconds": 1}))
    k.apply([{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
              "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}},
             {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web-headless"},
              "spec": {"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 8080}]}}])
    backend = k.wait("Pod", "backend", condition="Ready", timeout_s=30)
    service = k.get("Service", "web")
    assert service["spec"]["clusterIP"].startswith("127.11.") and service["spec"]["ports"][0]["protocol"] == "TCP"
    endpoints = wait_for(lambda: [s for s in (k.get("Endpoints", "web") or {}).get("subsets") or []
                                  if s.get("addresses")], 10, "the ready endpoint")
    assert endpoints == [{"addresses": [{"ip": backend["status"]["podIP"], "nodeName": "standin", "targetRef": {
        "kind": "Pod", "name": "backend", "namespace": "default", "uid": backend["metadata"]["uid"]}}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}]
    # the same endpoint in the Service's EndpointSlice, as kube-proxy and the operator read it
    # (written after the Endpoints, as by Kubernetes' two controllers: waited for on its own)
    def ready_slice():
        slices = k.list("EndpointSlice", labels={"kubernetes.io/service-name": "web"})
        ready = [(e["addresses"], e["targetRef"]["name"]) for s in slices for e in s["endpoints"]
                 if e["conditions"]["ready"]]
        return slices if ready == [([backend["status"]["podIP"]], "backend")] else None
    [web_slice] = wait_for(ready_slice, 10, "the ready endpoint in the slice")
    assert web_slice["addressType"] == "IPv4" and web_slice["ports"] == endpoints[0]["ports"]
    assert [(e["addresses"], e["conditions"]["ready"], e["targetRef"]["name"]) for e in web_slice["endpoints"]] \
        == [([backend["status"]["podIP"]], True, "backend")]
    k.apply(pod("client", ["sleep", "60"]))
    running(k, "client")
    fetch = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
    for url in ("http://web/whoami", "http://web.default/whoami", "http://web.default.svc.cluster.local/whoami",
                "http://web-headless:8080/whoami"):
        code, out = k.exec("client", ["python3", "-c", fetch, url])
        assert (code, out.strip()) == (0, "backend backend"), url
    code, out = k.exec("client", ["getent", "hosts", "web", "web-headless.default.svc"])
    assert out.split() == [service["spec"]["clusterIP"], "web.default.svc.cluster.local", "web.default.svc",
                           "web.default", "web", backend["status"]["podIP"],
                           "web-headless.default.svc.cluster.local", "web-headless.default.svc",
                           "web-headless.default", "web-headless"], out
    # from the test (the host): the Service's address works too
    assert urllib.request.urlopen(f"http://{service['spec']['clusterIP']}/whoami", timeout=5).read() == \
        b"backend backend"
    # not ready: no endpoint, the connection is refused at the Service address
    k.patch("Pod", "backend", {"metadata": {"labels": {"app": "other"}}})
    wait_for(lambda: not (k.get("Endpoints", "web") or {}).get("subsets"), 10, "the endpoint removed")
    wait_for(lambda: [s["endpoints"] for s in k.list("EndpointSlice", labels={"kubernetes.io/service-name": "web"})]
             == [[]], 10, "the slice emptied")
    code, out = k.exec("client", ["python3", "-c", fetch, "http://web/whoami"])
    assert code != 0 and ("Connection" in out or "closed" in out or "Remote end" in out), out


def test_pod_deletion_stops_the_process_with_grace_then_kill(cluster):
    k = cluster.kubectl
    k.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "out"},
             "spec": {"resources": {"requests": {"storage": "1Mi"}}}})
    volume = {"volumes": [{"name": "out", "persistentVolumeClaim": {"claimName": "out"}}],
              "container": {"volumeMounts": [{"name": "out", "mountPath": "/out"}]}}
    k.apply(pod("polite", ["sh", "-c", "trap 'echo TERM > /out/polite; exit 0' TERM; sleep 60 & wait"], **volume))
    k.apply(pod("stubborn", ["sh", "-c", "trap '' TERM; echo up > /out/stubborn; sleep 60 & wait; sleep 60"],
                **volume))
    for name in ("polite", "stubborn"):
        running(k, name)
    out = cluster.pvc_dir("default", "out")
    wait_for(lambda: (out / "stubborn").exists(), 10, "the stubborn Pod to start")
    k.delete("Pod", "polite", wait_s=10)
    assert (out / "polite").read_text() == "TERM\n"  # its trap ran: SIGTERM came first
    started = time.monotonic()
    assert k.delete("Pod", "stubborn")
    terminating = k.get("Pod", "stubborn")
    assert terminating["metadata"]["deletionGracePeriodSeconds"] == 2  # marked, not gone: the kubelet stops it
    wait_for(lambda: k.get("Pod", "stubborn") is None, 10, "the stubborn Pod gone")
    assert 2 <= time.monotonic() - started < 10  # the grace period, then SIGKILL
    assert not cluster.leaks()


def test_deployment_scales_and_rolls_within_surge_and_unavailability(cluster):
    k = cluster.kubectl
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "app"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "app"}},
                 "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                 "template": {"metadata": {"labels": {"app": "app"}}, "spec": server_pod("x")["spec"] | {
                     "containers": [server_pod("x", readinessProbe={"httpGet": {"path": "/", "port": "http"},
                                                                    "periodSeconds": 1})["spec"]["containers"][0]
                                    | {"env": [POD_NAME_ENV, {"name": "VERSION", "value": "1"}]}]}}}}
    k.apply(deployment)

    def available(n: int):
        d = k.get("Deployment", "app")
        status = d.get("status") or {}
        return d if (status.get("availableReplicas") == n and status.get("updatedReplicas") == n
                     and status.get("replicas") == n and status.get("observedGeneration") ==
                     d["metadata"]["generation"]) else None

    wait_for(lambda: available(2), 40, "2 available replicas")
    k.patch("Deployment", "app", {"spec": {"replicas": 3}})
    wait_for(lambda: available(3), 40, "3 available replicas")
    pods = k.list("Pod", labels={"app": "app"})
    assert len(pods) == 3 and all(p["metadata"]["ownerReferences"][0]["kind"] == "Deployment" for p in pods)
    old_hash = pods[0]["metadata"]["labels"]["pod-template-hash"]
    k.patch("Deployment", "app", {"spec": {"template": {"metadata": {"annotations": {"v": "2"}}}}})
    seen = []

    def rolled():
        live = [p for p in k.list("Pod", labels={"app": "app"}) if not p["metadata"].get("deletionTimestamp")]
        ready = [p for p in live if condition_status(p, "Ready") == "True"]
        seen.append((len(live), len(ready)))
        return available(3) and all(p["metadata"]["labels"]["pod-template-hash"] != old_hash for p in live)

    wait_for(rolled, 60, "the rollout")
    assert max(total for total, _ in seen) <= 4, seen  # maxSurge 1
    assert min(ready for _, ready in seen) >= 3, seen  # maxUnavailable 0
    condition = next(c for c in k.get("Deployment", "app")["status"]["conditions"] if c["type"] == "Progressing")
    assert condition["reason"] == "NewReplicaSetAvailable"


def test_deleting_an_owner_garbage_collects_its_dependents(cluster):
    k = cluster.kubectl

    def family(name: str, propagation: str | None):
        owner = k.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}})[0]
        ref = [{"apiVersion": "v1", "kind": "ConfigMap", "name": name, "uid": owner["metadata"]["uid"],
                "controller": True, "blockOwnerDeletion": True}]
        k.apply([{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-cm", "ownerReferences": ref}},
                 {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{name}-svc", "ownerReferences": ref},
                  "spec": {"ports": [{"port": 80}]}},
                 pod(f"{name}-pod", ["sh", "-c", "trap 'sleep 1; exit 0' TERM; sleep 60 & wait"])
                 | {"metadata": {"name": f"{name}-pod", "ownerReferences": ref}}])
        running(k, f"{name}-pod")
        started = time.monotonic()
        k.delete("ConfigMap", name, propagation=propagation)
        return started

    def dependents(name: str) -> list:
        return [o for o in (k.get("ConfigMap", f"{name}-cm"), k.get("Service", f"{name}-svc"),
                            k.get("Pod", f"{name}-pod")) if o is not None]

    family("bg", None)  # background: the owner goes at once, the collector follows
    assert k.get("ConfigMap", "bg") is None
    wait_for(lambda: not dependents("bg"), 15, "the background dependents gone")

    started = family("fg", "Foreground")  # foreground: the owner waits for its dependents
    owner = k.get("ConfigMap", "fg")
    assert owner is not None and "foregroundDeletion" in owner["metadata"]["finalizers"]
    wait_for(lambda: k.get("ConfigMap", "fg") is None, 15, "the foreground owner gone")
    assert not dependents("fg") and time.monotonic() - started >= 1  # after the Pod's 1 s shutdown

    family("orphan", "Orphan")  # orphan: the dependents stay, without the reference
    wait_for(lambda: k.get("ConfigMap", "orphan") is None, 10, "the orphaning owner gone")
    left = dependents("orphan")
    assert len(left) == 3 and not any(o["metadata"].get("ownerReferences") for o in left)


def test_real_clients_reach_the_api_through_the_kubeconfig(cluster):
    """kubectl and the kubernetes client use the kubeconfig's TLS endpoint, as against a
    real apiserver (kubectl apply needs --validate=false: no OpenAPI document is served)."""
    import kubernetes

    kubectl = tool_path("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: `make k8s-tools` puts it into .venv/bin")

    def run(*args: str, stdin: str | None = None) -> str:
        out = subprocess.run([str(kubectl), "--kubeconfig", str(cluster.kubeconfig), *args], input=stdin,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    manifest = yaml.safe_dump(pod("kubectl-pod", ["sh", "-c", "echo from-kubectl; trap 'exit 0' TERM;"
                                                  " sleep 60 & wait"]))
    assert "pod/kubectl-pod created" in run("apply", "--validate=false", "-f", "-", stdin=manifest)
    run("wait", "--for=condition=Ready", "pod/kubectl-pod", "--timeout=30s")
    assert json.loads(run("get", "pod", "kubectl-pod", "-o", "json"))["status"]["phase"] == "Running"
    wait_for(lambda: run("logs", "kubectl-pod") == "from-kubectl\n", 10, "kubectl logs")
    api = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(str(cluster.kubeconfig)))
    pods = api.list_namespaced_pod("default").items
    assert [(p.metadata.name, p.status.phase) for p in pods] == [("kubectl-pod", "Running")]
    assert "deleted" in run("delete", "pod", "kubectl-pod")  # waits until the object is gone
    assert cluster.kubectl.get("Pod", "kubectl-pod") is None


WIDGETS = {  # a CRD of no one's, with a scale subresource on fields of its own choosing
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.com"},
    "spec": {"group": "example.com", "scope": "Namespaced",
             "names": {"kind": "Widget", "plural": "widgets", "singular": "widget", "listKind": "WidgetList"},
             "versions": [{"name": "v1", "served": True, "storage": True,
                           "subresources": {"status": {}, "scale": {
                               "specReplicasPath": ".spec.size", "statusReplicasPath": ".status.size",
                               "labelSelectorPath": ".status.selector"}},
                           "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                               "spec": {"type": "object", "properties": {"size": {"type": "integer"}}},
                               "status": {"type": "object", "properties": {
                                   "size": {"type": "integer"}, "selector": {"type": "string"}}}}}}}]}}


def test_a_custom_resources_scale_subresource_serves_kubectl_scale(cluster):
    """A CRD's ``subresources.scale``: its objects answer ``GET .../scale`` with an
    autoscaling/v1 Scale, take a merge patch of it (a stale resourceVersion refused) and
    ``kubectl scale``, which finds the subresource through discovery."""
    kubectl = tool_path("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: `make k8s-tools` puts it into .venv/bin")
    k = cluster.kubectl
    k.apply(WIDGETS)
    k.apply({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {"size": 1}})
    k.patch("Widget", "w", {"status": {"size": 1, "selector": "app=w"}}, subresource="status")
    scale = k.get("Widget", "w", subresource="scale")
    assert (scale["apiVersion"], scale["kind"], scale["metadata"]["name"]) == ("autoscaling/v1", "Scale", "w")
    assert (scale["spec"], scale["status"]) == ({"replicas": 1}, {"replicas": 1, "selector": "app=w"})

    scaled = k.patch("Widget", "w", {"spec": {"replicas": 3}}, subresource="scale")
    assert scaled["kind"] == "Scale" and scaled["spec"]["replicas"] == 3
    widget = k.get("Widget", "w")
    assert widget["spec"] == {"size": 3} and widget["status"] == {"size": 1, "selector": "app=w"}
    with pytest.raises(KubectlError) as refused:
        k.patch("Widget", "w", {"metadata": {"resourceVersion": scale["metadata"]["resourceVersion"]},
                                "spec": {"replicas": 4}}, subresource="scale")
    assert refused.value.status == 409

    out = subprocess.run([str(kubectl), "--kubeconfig", str(cluster.kubeconfig), "scale", "widget/w",
                          "--replicas", "5"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "scaled" in out.stdout, out.stderr
    assert k.get("Widget", "w")["spec"] == {"size": 5}
