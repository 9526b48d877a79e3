"""A pool scaled through its PDPool, on the cluster stand-in with the chart's operator:
what an autoscaler does, done with ``kubectl scale``.

examples/minimal.yaml (the tiny preset, one prefill and one decode engine, the planner
off) under another name. The operator makes one PDPool per pool, each synced with the
PDCluster (its size, and the selector of the pool's engine Pods in the status). Then
``kubectl scale pdpool/<cluster>-decode --replicas 2`` (the real kubectl, through the
kubeconfig; it finds the scale subresource by discovery and patches it, as the
HorizontalPodAutoscaler's and KEDA's scale clients do): the PDCluster's
``spec.decode.replicas`` becomes 2 (a ``ScaledByPool`` Event says so), a second decode
PDInstance comes up and serves, and the PDPool's scale reports two engines.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.e2e.test_pdcluster_e2e import CLUSTER_LABEL, SERVING, chart, etcd, install, until  # noqa: F401
from tests.kube_tools import tool_path
from tests.procs import REPO

pytestmark = pytest.mark.timeout(180)

NAME = "scaled"


def test_kubectl_scale_of_a_pdpool_resizes_its_pool(cluster, chart):  # noqa: F811 - the fixture
    kubectl = tool_path("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: `make k8s-tools` puts it into .venv/bin")
    k = cluster.kubectl
    install(cluster, chart)
    manifest = yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text())
    manifest["metadata"] = {"name": NAME, "namespace": SERVING}
    k.apply(manifest)

    def pdpools() -> dict[str, dict]:
        return {p["metadata"]["name"]: p for p in k.list("PDPool", SERVING, labels={CLUSTER_LABEL: NAME})}

    def synced() -> dict[str, dict] | None:
        found = pdpools()
        names = [f"{NAME}-{pool}" for pool in ("prefill", "decode", "hybrid")]
        return found if sorted(found) == sorted(names) and all(
            (found[n].get("status") or {}).get("observedClusterReplicas") == found[n]["spec"]["replicas"]
            for n in names) else None

    found = until(cluster, synced, 60, "one PDPool per pool, synced with the PDCluster")
    assert {n: p["spec"]["replicas"] for n, p in found.items()} == {
        f"{NAME}-prefill": 1, f"{NAME}-decode": 1, f"{NAME}-hybrid": 0}
    decode = found[f"{NAME}-decode"]
    assert decode["metadata"]["ownerReferences"][0]["kind"] == "PDCluster"
    selector = f"pdserve.io/cluster={NAME},pdserve.io/component=engine,pdserve.io/pool=decode"
    assert decode["status"]["selector"] == selector

    # what an autoscaler does: the scale subresource, here through kubectl
    out = subprocess.run([str(kubectl), "--kubeconfig", str(cluster.kubeconfig), "--namespace", SERVING,
                          "scale", f"pdpool/{NAME}-decode", "--replicas", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "scaled" in out.stdout, out.stderr
    until(cluster, lambda: k.get("PDCluster", NAME, SERVING)["spec"]["decode"]["replicas"] == 2, 30,
          "spec.decode.replicas written by the operator")
    until(cluster, lambda: f"{NAME}-decode-1" in {i["metadata"]["name"] for i in k.list("PDInstance", SERVING)},
          30, f"PDInstance {NAME}-decode-1")

    # the second engine serves: the PDCluster counts it, and so does the PDPool's scale
    def serving():
        scale = k.get("PDPool", f"{NAME}-decode", SERVING, subresource="scale") or {}
        status = (k.get("PDCluster", NAME, SERVING) or {}).get("status") or {}
        return scale if status.get("readyDecode") == 2 and (scale.get("status") or {}).get("replicas") == 2 \
            else None

    scale = until(cluster, serving, 120, "two decode engines ready")
    assert (scale["kind"], scale["spec"]["replicas"], scale["status"]["selector"]) == ("Scale", 2, selector)
    pods = k.list("Pod", SERVING, labels=selector)
    assert sorted(p["metadata"]["name"] for p in pods) == [f"{NAME}-decode-0", f"{NAME}-decode-1"]
    until(cluster, lambda: pdpools()[f"{NAME}-decode"]["status"].get("readyReplicas") == 2, 30,
          "the PDPool's readyReplicas")
    # the operator posts a pass's Events after its changes, so they may trail them a little
    message = f"spec.decode.replicas 1 -> 2 (PDPool {NAME}-decode was scaled)"
    until(cluster, lambda: [e for e in k.list("Event", SERVING) if e["involvedObject"].get("name") == NAME
                            and e.get("reason") == "ScaledByPool" and e.get("message") == message], 30,
          "the ScaledByPool Event")
