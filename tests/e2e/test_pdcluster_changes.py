"""A PDCluster serving a checkpoint from a PersistentVolumeClaim, then changed in place
(issue 12), on the cluster stand-in with the chart's operator.

The checkpoint is made here: a tiny random Llama (``save_pretrained``) with a
word-level ``tokenizer.json`` and a ``tokenizer_config.json`` carrying a chat
template, written into the claim's directory (``Cluster.pvc_dir``). Through the
Coordinator Service, with the official ``openai`` client: a text completion, and a
streamed greedy chat completion equal to the non-streamed one (the Coordinator read
the tokenizer from the claim; it answered 400 without one). Then two changes a user
makes with ``kubectl patch``:

- the decode routing policy: the Coordinator rolls (its ``/ui/state`` reports the new
  policy) and no engine Pod is replaced;
- an engine-only setting (``spec.engine.maxNumSeqs``): the engine Pods roll one per
  pool at a time, sampled throughout (each pool keeps a Ready Pod, at most one per pool
  not Ready), while a request loop sees no error; at the end every engine Pod carries
  a new settings hash.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
import yaml

from tests.e2e.standin import condition_status
from tests.e2e.test_pdcluster_e2e import CLUSTER_LABEL, SERVING, chart, etcd, install, until  # noqa: F401
from tests.procs import REPO

pytestmark = pytest.mark.timeout(300)

NAME, CLAIM, SUB_PATH = "ckpt", "weights", "llama-tiny"
COMPONENT_LABEL, POOL_LABEL, HASH_LABEL = "pdserve.io/component", "pdserve.io/pool", "pdserve.io/spec-hash"
VOCAB = 320
PROMPT = "w5 w17 w42 w101 w7"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}w3"


def write_checkpoint(path) -> None:
    """A random Llama with a word-level tokenizer and a chat template, as a user's PVC holds it."""
    from tests.unit.engine.hf_models import build_hf_model, save_hf_model, save_word_tokenizer

    save_hf_model(build_hf_model("llama", vocab_size=VOCAB), path)
    save_word_tokenizer(path, VOCAB)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE,
                                                            "add_bos_token": False}))


def engine_pods(k) -> list[dict]:
    return k.list("Pod", SERVING, labels={CLUSTER_LABEL: NAME, COMPONENT_LABEL: "engine"})


def is_ready(pod: dict) -> bool:
    return (not pod["metadata"].get("deletionTimestamp") and (pod.get("status") or {}).get("phase") == "Running"
            and condition_status(pod, "Ready") == "True")


def test_a_pvc_checkpoint_serves_openai_clients_and_changes_roll_as_they_should(cluster, chart):  # noqa: F811 - the fixture
    import openai

    k = cluster.kubectl
    install(cluster, chart)
    checkpoint = cluster.pvc_dir(SERVING, CLAIM) / SUB_PATH
    checkpoint.mkdir()
    write_checkpoint(checkpoint)
    k.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM, "namespace": SERVING},
             "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    manifest = yaml.safe_load((REPO / "examples" / "minimal.yaml").read_text())
    manifest["metadata"] = {"name": NAME, "namespace": SERVING}
    manifest["spec"]["model"] = {"pvc": {"claimName": CLAIM, "subPath": SUB_PATH}}
    manifest["spec"]["prefill"]["replicas"] = manifest["spec"]["decode"]["replicas"] = 2
    k.apply(manifest)

    def ready():
        pdc = k.get("PDCluster", NAME, SERVING) or {}
        status = pdc.get("status") or {}
        return pdc if (condition_status(pdc, "Ready") == "True"
                       and status.get("observedGeneration") == pdc["metadata"]["generation"]
                       and condition_status(pdc, "Progressing") == "False") else None

    status = until(cluster, ready, 180, f"PDCluster {NAME} Ready")["status"]
    assert (status["readyPrefill"], status["readyDecode"]) == (2, 2), status
    address = cluster.resolve(f"{NAME}-coordinator.{SERVING}.svc")
    client = openai.OpenAI(base_url=f"http://{address}:8000/v1", api_key="unused", timeout=60, max_retries=0)

    # 1. the Coordinator tokenizes with the claim's tokenizer.json: text and chat
    completion = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    assert completion.choices[0].text.strip(), completion
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0)
    text = chat.choices[0].message.content
    assert text, chat
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0,
                                            stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text, (streamed, text)

    # 2. a routing change rolls the Coordinator only
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in engine_pods(k)}
    old_coordinators = {p["metadata"]["uid"] for p in k.list("Pod", SERVING, labels={
        CLUSTER_LABEL: NAME, COMPONENT_LABEL: "coordinator"})}
    k.patch("PDCluster", NAME, {"spec": {"routing": {"decodePolicy": "round_robin"}}}, SERVING)

    def new_coordinator():
        pods = k.list("Pod", SERVING, labels={CLUSTER_LABEL: NAME, COMPONENT_LABEL: "coordinator"})
        return pods if (pods and ready() and all(p["metadata"]["uid"] not in old_coordinators and is_ready(p)
                                                 for p in pods)) else None

    [coordinator] = until(cluster, new_coordinator, 90, "the Coordinator replaced, alone and Ready")
    args = coordinator["spec"]["containers"][0]["args"]
    assert args[args.index("--decode-policy") + 1] == "round_robin", args
    state = json.loads(urllib.request.urlopen(f"http://{address}:8000/ui/state", timeout=10).read())
    assert state["cluster"]["decode_policy"] == "round_robin", state["cluster"]
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in engine_pods(k)} == uids

    # 3. an engine setting rolls the engines one per pool at a time, serving throughout
    old_hashes = {p["metadata"]["labels"][HASH_LABEL] for p in engine_pods(k)}
    errors, sent, stop = [], [0], threading.Event()

    def send() -> None:
        while not stop.is_set():
            try:
                client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
            except Exception as exc:  # noqa: BLE001 - every failure counts
                errors.append(repr(exc))
            sent[0] += 1
            time.sleep(0.2)

    loop = threading.Thread(target=send, daemon=True)
    loop.start()
    k.patch("PDCluster", NAME, {"spec": {"engine": {"maxNumSeqs": 32}}}, SERVING)
    samples, bad, mixed = 0, [], 0
    deadline = time.monotonic() + 180
    try:
        while True:
            pods = engine_pods(k)
            samples += 1
            for pool in ("prefill", "decode"):
                members = [p for p in pods if p["metadata"]["labels"].get(POOL_LABEL) == pool]
                n_ready = sum(is_ready(p) for p in members)
                if n_ready < 1 or len(members) - n_ready > 1:
                    bad.append((pool, sorted((p["metadata"]["name"], is_ready(p)) for p in members)))
            hashes = {p["metadata"]["labels"].get(HASH_LABEL) for p in pods}
            mixed += bool(hashes & old_hashes and hashes - old_hashes)  # old and new settings serving together
            if len(pods) == 4 and not hashes & old_hashes and all(map(is_ready, pods)) and ready():
                break
            assert time.monotonic() < deadline, f"the engine rollout did not finish\n{cluster.diagnostics()}"
            time.sleep(0.5)
    finally:
        stop.set()
        loop.join(timeout=70)
    assert not bad, f"{len(bad)} of {samples} samples broke the rollout's bounds: {bad[:5]}"
    assert not errors, f"{len(errors)} of {sent[0]} requests failed during the roll: {errors[:3]}"
    assert sent[0] > 0 and mixed, (sent[0], samples, mixed)  # the roll was watched, not only its end
    assert len({p["metadata"]["labels"][HASH_LABEL] for p in engine_pods(k)
                if p["metadata"]["labels"][POOL_LABEL] == "decode"}) == 1
