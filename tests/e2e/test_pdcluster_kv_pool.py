"""A PDCluster with ``kvPool.enabled`` on the cluster stand-in: the operator runs the
pool's master as its own Deployment and Service, every engine Pod joins it, and a
prompt one prefill engine computed is a prefix-cache hit on the other (round-robin
prefill), fetched from the pool, seen in the usage the Coordinator answers with."""

from __future__ import annotations

import json

import pytest

from tests.e2e.standin import condition_status
from tests.e2e.test_pdcluster_e2e import (  # noqa: F401
    CLUSTER_LABEL,
    SERVING,
    chart,
    etcd,
    install,
    start_client,
    until,
)

pytestmark = pytest.mark.timeout(300)

NAME = "pooled"
ASK = """
import json, sys, urllib.request
body = json.dumps({"model": "tiny", "prompt": "a system prompt every request shares, " * 12,
                   "max_tokens": 2}).encode()
request = urllib.request.Request(sys.argv[1], body, {"Content-Type": "application/json"})
print(urllib.request.urlopen(request, timeout=60).read().decode())
"""


def test_the_operator_runs_the_pool_and_engines_share_prefixes_through_it(cluster, chart):  # noqa: F811
    k = cluster.kubectl
    install(cluster, chart)
    k.apply({"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
             "metadata": {"name": NAME}, "spec": {
                 "model": {"preset": "tiny", "servedName": "tiny"},
                 "engine": {"dtype": "float32", "kvCacheBytes": "16Mi", "blockSize": 16},
                 "prefill": {"replicas": 2}, "decode": {"replicas": 1},
                 "routing": {"prefillPolicy": "round_robin", "localPrefillMaxTokens": 0,
                             "loadAwareLocalPrefill": False},
                 "kvPool": {"enabled": True, "segmentSize": "32Mi"}}}, namespace=SERVING)
    until(cluster, lambda: condition_status(k.get("PDCluster", NAME, SERVING) or {}, "Ready") == "True",
          180, f"PDCluster {NAME} Ready")
    pods = k.list("Pod", SERVING, labels={CLUSTER_LABEL: NAME})
    pool = [p for p in pods if p["metadata"]["labels"]["pdserve.io/component"] == "kv-pool"]
    assert len(pool) == 1 and pool[0]["status"]["phase"] == "Running", [p["metadata"]["name"] for p in pods]
    assert k.get("Service", f"{NAME}-kv-pool", SERVING)["spec"]["ports"][0]["port"] == 50551
    start_client(cluster)
    url = f"http://{NAME}-coordinator.{SERVING}.svc:8000/v1/completions"
    cached = []
    for _ in range(2):
        code, out = k.exec("client", ["python3", "-c", ASK, url], SERVING, timeout_s=90)
        assert code == 0, f"{out}\n{cluster.diagnostics()}"
        cached.append(json.loads(out)["usage"]["prompt_tokens_details"]["cached_tokens"])
        k.exec("client", ["sleep", "1"], SERVING)  # the first prefill engine's puts land
    # 456 prompt tokens: the second prefill engine found all 28 full blocks in the pool
    assert cached == [0, 28 * 16], f"{cached}\n{cluster.diagnostics()}"
    assert k.delete("PDCluster", NAME, SERVING)
    until(cluster, lambda: not k.list("Deployment", SERVING, labels={CLUSTER_LABEL: NAME}), 90,
          "the pool's Deployment gone with its cluster")
