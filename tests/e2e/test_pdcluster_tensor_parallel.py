"""``kubectl apply -f examples/tensor-parallel-pd.yaml`` on the cluster stand-in: the
operator's prefill Pod runs its engine at tensor parallelism 2, the decode Pod at 1, and
a completion asked through the Coordinator's Service is what one TP=1 engine generates
for the prompt: every request's KV crossed from two ranks into one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

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

EXAMPLE = Path(__file__).parents[2] / "examples" / "tensor-parallel-pd.yaml"
PROMPT = [(13 * i + 7) % 250 + 1 for i in range(60)]
ASK = """
import json, sys, urllib.request
body = json.dumps({"model": "tp-pd", "prompt": json.loads(sys.argv[2]), "max_tokens": 8,
                   "temperature": 0}).encode()
request = urllib.request.Request(sys.argv[1], body, {"Content-Type": "application/json"})
print(urllib.request.urlopen(request, timeout=60).read().decode())
"""

# Processes started by multiprocessing's spawn in the Pod: an engine's ranks 1..N-1.
RANKS = """
import os
print(sum(b"--multiprocessing-fork" in open(f"/proc/{p}/cmdline", "rb").read()
          for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()))
"""


def _reference_text() -> str:
    from pdserve.api.sampling import SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", kv_transport="none"))
    try:
        [tokens] = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))
        return engine.tokenizer.decode(tokens)
    finally:
        engine.close()


def test_a_tp2_prefill_pod_feeds_a_tp1_decode_pod(cluster, chart):  # noqa: F811
    k = cluster.kubectl
    install(cluster, chart)
    manifest = yaml.safe_load(EXAMPLE.read_text())
    name = manifest["metadata"]["name"]
    k.apply(manifest, namespace=SERVING)
    until(cluster, lambda: condition_status(k.get("PDCluster", name, SERVING) or {}, "Ready") == "True",
          180, f"PDCluster {name} Ready")
    pods = k.list("Pod", SERVING, labels={CLUSTER_LABEL: name})
    ranks = {}
    for pod in pods:
        pool = pod["metadata"]["labels"].get("pdserve.io/pool")
        if pool in ("prefill", "decode"):
            code, out = k.exec(pod["metadata"]["name"], ["python3", "-c", RANKS], SERVING)
            assert code == 0, out
            ranks[pool] = int(out)
    assert ranks == {"prefill": 1, "decode": 0}  # the engine is rank 0; TP=2 has one more
    start_client(cluster)
    url = f"http://{name}-coordinator.{SERVING}.svc:8000/v1/completions"
    code, out = k.exec("client", ["python3", "-c", ASK, url, json.dumps(PROMPT)], SERVING,
                       timeout_s=90)
    assert code == 0, f"{out}\n{cluster.diagnostics()}"
    assert json.loads(out)["choices"][0]["text"] == _reference_text()
    assert k.delete("PDCluster", name, SERVING)
