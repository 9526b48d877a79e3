"""``kubectl apply -f examples/vllm-pd-cpu.yaml`` on the cluster stand-in: the operator's
prefill and decode Pods each run a NodeAgent that starts vLLM (the CPU build of
``.venv-vllm``, on the Pod's address, with its NixlConnector), and a chat completion
asked through the Coordinator's Service comes back from the real model, its KV pulled
by the decode vLLM from the prefill one (its external prefix-cache hits, read from
its own ``/metrics`` at the address the Coordinator drove it at).

Needs ``.venv-vllm`` and the model (``scripts/vllm-env.sh``, which ``make test`` runs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

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
from tests.procs import REPO

pytestmark = pytest.mark.timeout(600)

EXAMPLE = REPO / "examples" / "vllm-pd-cpu.yaml"
VENV = REPO / ".venv-vllm"
MODEL_DIR = Path(os.environ.get("PDSERVE_VLLM_MODEL_DIR", Path.home() / ".cache/pdserve/vllm/smollm2-f32"))
LONG = ("Prefill and decode run on two engines here: the first reads the whole prompt and "
        "hands its KV cache to the second, which writes the answer token by token. In one "
        "short sentence, why would anyone split the work that way?")
ASK = """
import json, sys, urllib.request
body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": sys.argv[2]}],
                   "max_tokens": 16, "temperature": 0}).encode()
request = urllib.request.Request(sys.argv[1], body, {"Content-Type": "application/json"})
print(urllib.request.urlopen(request, timeout=120).read().decode())
"""
READ = """
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())
"""
READY = """
import sys, urllib.request, urllib.error
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())
except urllib.error.HTTPError as e:  # 503 while not ready: its body says why
    print(e.read().decode())
"""
METRIC = """
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
print(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
          if line.startswith("vllm:external_prefix_cache_hits_total")))
"""


def manifest() -> dict:
    """The CPU example with this checkout's paths (a Pod sees the host's files)."""
    m = yaml.safe_load(EXAMPLE.read_text())
    m["spec"]["model"]["path"] = str(MODEL_DIR)
    vllm = m["spec"]["engine"]["vllm"]
    vllm["command"][0] = str(VENV / "bin/python")
    vllm["env"]["LD_PRELOAD"] = vllm["env"]["LD_PRELOAD"].replace(".venv-vllm/", f"{VENV}/")
    return m


def test_the_cpu_example_serves_a_chat_through_vllm_pods(cluster, chart):  # noqa: F811
    assert (VENV / "bin/python").exists() and (MODEL_DIR / ".done").exists(), (
        "vLLM's venv or the model is missing: run scripts/vllm-env.sh (make test does)")
    k = cluster.kubectl
    install(cluster, chart)
    m = manifest()
    name = m["metadata"]["name"]
    k.apply(m, namespace=SERVING)
    until(cluster, lambda: condition_status(k.get("PDCluster", name, SERVING) or {}, "Ready") == "True",
          420, f"PDCluster {name} Ready")
    start_client(cluster)
    base = f"http://{name}-coordinator.{SERVING}.svc:8000"

    def routable() -> bool:  # the Coordinator pairs them: the view in PD, the pair's probe passed
        code, out = k.exec("client", ["python3", "-c", READY, base + "/ready"], SERVING, timeout_s=30)
        detail = json.loads(out)["detail"] if code == 0 else {}
        return detail.get("mode") == "PD" and detail.get("pd") == "ok"
    until(cluster, routable, 180, "the Coordinator routing P/D pairs")
    code, out = k.exec("client", ["python3", "-c", ASK, base + "/v1/chat/completions", LONG], SERVING,
                       timeout_s=180)
    assert code == 0, f"{out}\n{cluster.diagnostics()}"
    answer = json.loads(out)
    assert answer["choices"][0]["message"]["content"].strip() and answer["usage"]["completion_tokens"] == 16
    # the engines the Coordinator drove: vLLM servers on their Pods' addresses
    code, out = k.exec("client", ["python3", "-c", READ, base + "/ready?verbose=1"], SERVING, timeout_s=30)
    assert code == 0, out
    engines = {parse_qs(urlsplit(a).query)["role"][0]: urlsplit(a).netloc for a in json.loads(out)["sessions"]}
    assert sorted(engines) == ["decode", "prefill"], out
    code, out = k.exec("client", ["python3", "-c", METRIC, f"http://{engines['decode']}/metrics"], SERVING,
                       timeout_s=30)
    assert code == 0 and float(out) >= 64, out  # D took the prompt's KV from P
    assert k.delete("PDCluster", name, SERVING)
