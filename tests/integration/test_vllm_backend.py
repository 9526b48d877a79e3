"""vLLM under pdserve's control plane, the user's way: ``pdserve up -f examples/vllm-pd-cpu.yaml``
starts the Controller, a NodeAgent that launches a prefill and a decode vLLM (the CPU
build, ``.venv-vllm``, with its NixlConnector) and the Coordinator; a client talks to
the Coordinator's OpenAI endpoint on the real model (SmolLM2-135M-Instruct, float32).

What it shows: the chat template, tokenizer and greedy tokens through pdserve's PD are
what vLLM alone answers to the same messages; the decode engine loaded the prompt's KV
from the prefill engine over NIXL (its external prefix-cache hits); both engines'
prefix-cache events reach the Coordinator's prefix index; a stream carries
the same text and its usage; ``pdserve doctor`` passes, its test request through the
pair moving a prompt from P to D; a decode vLLM killed mid-stream is continued on the
prefill vLLM (fallen back to whole requests) with the tokens one vLLM would have
given; Ctrl-C leaves no vLLM process behind. And a vLLM that
cannot start stops ``pdserve up`` with vLLM's own error line.

Needs ``.venv-vllm`` and the model (``scripts/vllm-env.sh``, which ``make test`` runs).
Slow: the two servers start in about 70 s together (eager: no torch.compile).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.etcd import free_port
from tests.procs import PDSERVE, REPO, Proc

VENV = REPO / ".venv-vllm"
MODEL_DIR = Path(os.environ.get("PDSERVE_VLLM_MODEL_DIR", Path.home() / ".cache/pdserve/vllm/smollm2-f32"))
EXAMPLE = REPO / "examples" / "vllm-pd-cpu.yaml"
START_S = 480.0
STOP_S = 90.0  # up stops its components one by one; the NodeAgent gives vLLM 15 s
LONG = ("Prefill and decode run on two engines here: the first reads the whole prompt and "
        "hands its KV cache to the second, which writes the answer token by token. The first "
        "is busy in bursts, one long matrix product per prompt; the second is busy all the "
        "time, one small step per token for every stream it holds. Put both on one engine and "
        "every long prompt that arrives stalls every stream for as long as its prefill takes; "
        "split them and the streams keep their pace, at the price of moving the cache across. "
        "On a machine of two cores, with a model of one hundred and thirty five million "
        "parameters, both halves are small, and yet the difference shows. In one short "
        "sentence, why would anyone split the work that way?")  # over one 128-token vLLM block

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module", autouse=True)
def vllm_installed():
    assert (VENV / "bin/python").exists() and (MODEL_DIR / ".done").exists(), (
        "vLLM's venv or the model is missing: run scripts/vllm-env.sh (make test does)")


def spec_file(tmp_path: Path, pools: dict | None = None, **vllm_changes) -> Path:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["model"]["path"] = str(MODEL_DIR)
    manifest["spec"]["engine"]["vllm"].update(vllm_changes)
    manifest["spec"].update(pools or {})
    path = tmp_path / "vllm-pd-cpu.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def group_pids(group: int) -> list[int]:
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().split(") ", 1)[1].split()
        except OSError:
            continue
        if int(stat[2]) == group:
            pids.append(int(entry))
    return pids


def is_running(pid: int) -> bool:
    """The process exists and is not a zombie waiting for its reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def vllm_servers(nodeagent_group: int) -> dict[str, tuple[int, int]]:
    """The pid and HTTP port of each vLLM server the NodeAgent started, by its KV role."""
    servers = {}
    for pid in group_pids(nodeagent_group):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "vllm.entrypoints.openai.api_server" in argv and "--kv-transfer-config" in argv:
            role = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_role"]
            servers[role] = (pid, int(argv[argv.index("--port") + 1]))
    return servers


def stream_chat(url: str, content: str, max_tokens: int, on_chunk=lambda n: None) -> tuple[str, list]:
    """A streamed chat answer's text and events; ``on_chunk(n)`` after the n-th content chunk."""
    chunks, events = [], []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=300, json={
            "model": "smollm2", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as s:
        assert s.status_code == 200, s.read()
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            assert "error" not in events[-1], events[-1]
            for choice in events[-1]["choices"]:
                if choice["delta"].get("content"):
                    chunks.append(choice["delta"]["content"])
                    on_chunk(len(chunks))
    return "".join(chunks), events


def metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


def chat(url: str, content: str, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=180, json={
        "model": "smollm2", "messages": [{"role": "user", "content": content}],
        "max_tokens": 24, "temperature": 0, **extra})


def test_up_runs_vllm_prefill_and_decode_behind_the_coordinator(tmp_path):
    port, run_dir = free_port(), tmp_path / "run"
    up = Proc([*PDSERVE, "up", "-f", str(spec_file(tmp_path)), "--port", str(port),
               "--run-dir", str(run_dir)])
    try:
        up.wait_for(r"pdserve is up", timeout_s=START_S)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120  # the pair's probe passed, the view in PD
        while (ready := httpx.get(url + "/ready", timeout=10).json()["detail"]) != {
                **ready, "mode": "PD", "pd": "ok"}:
            assert time.monotonic() < deadline, ready
            time.sleep(0.5)
        group = json.loads((run_dir / "processes.json").read_text())["groups"]["nodeagent"]
        servers = vllm_servers(group)
        assert sorted(servers) == ["kv_consumer", "kv_producer"], servers
        (decode_pid, decode), (_, prefill) = servers["kv_consumer"], servers["kv_producer"]

        # a long prompt goes through both engines: D pulls its KV from P
        hits = metric(decode, "vllm:external_prefix_cache_hits_total")
        r = chat(url, LONG)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["choices"][0]["message"]["content"].strip(), answer
        assert metric(decode, "vllm:external_prefix_cache_hits_total") - hits >= 64
        # ... and says what vLLM alone says to the same messages (its own chat template)
        alone = chat(f"http://127.0.0.1:{prefill}", LONG).json()
        assert answer["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
        assert answer["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]
        assert answer["usage"]["completion_tokens"] == alone["usage"]["completion_tokens"]

        # both engines' prefix-cache events (vLLM's ZMQ publisher) feed the prefix index
        def event_streams() -> float:
            text = httpx.get(url + "/metrics", timeout=10).text
            return sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("pdserve_coordinator_kv_event_streams"))
        deadline = time.monotonic() + 30
        while event_streams() < 2:
            assert time.monotonic() < deadline, f"{event_streams()} KV event streams"
            time.sleep(0.5)

        # the doctor: every check passes, and its test request went through the pair
        # (D took a fresh prompt from P over NIXL)
        # (each vLLM's NIXL progress thread polls without a pause: on a two-core host the
        # doctor shares both cores with them, and its imports alone can take a minute)
        doctor = subprocess.run([*PDSERVE, "doctor", "-f", str(spec_file(tmp_path)), "--run-dir",
                                 str(run_dir), "--json"], capture_output=True, text=True, timeout=420)
        rows = {row["name"]: row for row in json.loads(doctor.stdout)}
        assert [row for row in rows.values() if row["status"] == "fail"] == [], doctor.stdout
        pair = [row for name, row in rows.items() if name.startswith("kv ") and "->" in name]
        assert len(pair) == 1 and "prompt tokens P -> D over NixlConnector" in pair[0]["detail"], rows
        assert rows["vllm versions"]["status"] == "pass", rows

        # a short one, streamed with its usage (D may prefill it itself: conditional disaggregation)
        short = "What is the capital of France?"
        text, events = stream_chat(url, short, 16)
        alone = chat(f"http://127.0.0.1:{decode}", short, max_tokens=16, ignore_eos=True).json()
        assert text == alone["choices"][0]["message"]["content"], (text, alone)
        assert events[-1]["usage"]["completion_tokens"] == 16

        # D killed mid-stream: the Controller falls back to P as a whole-request engine
        # (in place), and the stream goes on there from the tokens already sent
        story = "Tell me a long story about a lighthouse keeper and his cat."
        expected = chat(f"http://127.0.0.1:{prefill}", story, max_tokens=96, ignore_eos=True).json()

        # (P's first token is the first chunk, so the second is D's: D is decoding. vLLM merges
        # the tokens its API server has not sent yet into one chunk, so on a loaded host the 96
        # tokens can come in fewer than a dozen chunks: the kill waits for no chunk number
        # past the second)
        killed_at: list[int] = []

        def kill_decode(num_chunks: int) -> None:
            if num_chunks >= 2 and not killed_at:
                os.kill(decode_pid, signal.SIGKILL)
                killed_at.append(num_chunks)
        text, events = stream_chat(url, story, 96, kill_decode)
        assert killed_at, "the stream ended before its second chunk"
        assert not Path(f"/proc/{decode_pid}/cmdline").exists() or \
            not Path(f"/proc/{decode_pid}/cmdline").read_bytes(), "D was not killed"
        assert text == expected["choices"][0]["message"]["content"], (text, expected)
        assert events[-1]["usage"]["completion_tokens"] == 96
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert any(line.startswith("pdserve_coordinator_continuations_total") and float(line.split()[-1]) >= 1
                   for line in metrics.splitlines()), "no continuation counted"

        engines = group_pids(group)
        up.signal(signal.SIGINT)
        assert up.popen.wait(90) == 0, up.output[-3000:]
        deadline = time.monotonic() + 10
        while (left := [p for p in engines if is_running(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in left]
    finally:
        up.stop(STOP_S)


def test_a_vllm_that_cannot_start_stops_up_with_vllms_error(tmp_path):
    port, run_dir = free_port(), tmp_path / "run"
    spec = spec_file(tmp_path, {"prefill": {"replicas": 0}, "decode": {"replicas": 0},
                                "hybrid": {"replicas": 1}}, extraArgs=["--max-num-seqs", "many"])
    up = Proc([*PDSERVE, "up", "-f", str(spec), "--port", str(port), "--run-dir", str(run_dir)])
    try:
        assert up.popen.wait(240) == 1, up.output[-3000:]
    finally:
        up.stop(STOP_S)
    assert "engine vllm-pd-cpu-hybrid-0 cannot start: it exited twice in a row with code 2" in up.output, \
        up.output[-3000:]
    assert "argument --max-num-seqs: invalid" in up.output, up.output[-3000:]
