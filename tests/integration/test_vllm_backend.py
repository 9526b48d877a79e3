"""The Coordinator driving real vLLM servers (CPU, float32, SmolLM2-135M-Instruct):
one prefill and one decode engine with vLLM's NixlConnector, started from .venv-vllm
(scripts/vllm-env.sh builds it and the model; scripts/vllm-serve.sh starts one).

Greedy token ids through pdserve's PD equal the decode engine's own answer to the
same prompt (its single-leg path), and D loaded the prompt's KV from P (its external
prefix-cache hits). Skipped where .venv-vllm or the model is missing. Slow: the two
servers start in about 70 s together (eager: --enforce-eager skips vLLM's compile).
"""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import httpx
import pytest

from pdserve.coordinator.app import create_app
from pdserve.coordinator.instances import InstanceRegistry
from pdserve.coordinator.pairs import PairChecks
from pdserve.coordinator.settings import CoordinatorSettings
from pdserve.coordinator.vllm_engine import VllmBackend
from tests.procs import REPO, Proc
from tests.unit.coordinator.harness import ALWAYS_PD, AppServer

VENV = REPO / ".venv-vllm"
MODEL_DIR = Path(os.environ.get("PDSERVE_VLLM_MODEL_DIR", Path.home() / ".cache/pdserve/vllm/smollm2-f32"))
START_S = 420.0
PROMPTS = [
    [504, 3575, 282, 4649, 314],  # "The capital of France is"
    [29039, 388, 284, 26420, 1658, 335, 827, 9396, 42],  # "Prefill and decode run on two engines:"
    list(range(1000, 1040)),  # 40 tokens: more than one KV block
]

pytestmark = [
    pytest.mark.skipif(not (VENV / "bin/python").exists() or not (MODEL_DIR / ".done").exists(),
                       reason="no .venv-vllm or model: run scripts/vllm-env.sh"),
    pytest.mark.timeout(1200),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(address: str, path: str) -> httpx.Response:
    return httpx.get(f"http://{address}{path}", timeout=10)


def metric(address: str, name: str, **labels: str) -> float:
    """The sum of a vLLM metric's samples that have ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in get(address, "/metrics").text.splitlines()
               if (line.startswith(name + "{") or line.startswith(name + " "))
               and all(w in line for w in want))


def eventually(check, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not so after {timeout_s:g} s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def vllm():
    """P on core 0, D on core 1; both started at once."""
    procs, addrs = {}, {}
    for role, core in (("prefill", "0"), ("decode", "1")):
        port = free_port()
        procs[role] = Proc(["bash", "scripts/vllm-serve.sh", role, str(port), "--enforce-eager",
                            "--enable-log-requests"],  # "Request ... aborted." in the log
                           env={"VLLM_CPU_OMP_THREADS_BIND": core, "NIXL_PORT": str(free_port())})
        addrs[role] = f"127.0.0.1:{port}"
    try:
        for proc in procs.values():
            proc.wait_for(r"Application startup complete", START_S)
        yield procs, addrs
    finally:
        for proc in procs.values():
            proc.stop(30)


class TrustedPairs(PairChecks):
    """vLLM serves no KV-path probe (``VllmEngine.probe_peer`` is Unsupported): NIXL
    handshakes on a pair's first transfer, so the test takes every pair as usable."""

    async def _ask(self, p, d):
        return True, "", 0.0


def coordinator(loop, addrs) -> AppServer:
    backend = VllmBackend({addrs["prefill"]: "prefill", addrs["decode"]: "decode"})
    registry = InstanceRegistry(connect=backend.connect)
    settings = CoordinatorSettings(engines=(addrs["prefill"], addrs["decode"]), model="smollm2",
                                   poll_interval_s=1.0, **ALWAYS_PD)
    return AppServer(loop, create_app(settings, registry=registry, pairs=TrustedPairs(registry)))


def decode_alone(addrs, prompt: list[int], max_tokens: int) -> list[int]:
    """D's own greedy answer: a plain request, no KV connector parameters."""
    r = httpx.post(f"http://{addrs['decode']}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def test_pd_through_pdserve_equals_the_decode_engine_alone(vllm, loop):
    procs, addrs = vllm
    want = [decode_alone(addrs, prompt, 12) for prompt in PROMPTS]
    hits_before = metric(addrs["decode"], "vllm:external_prefix_cache_hits_total")
    with coordinator(loop, addrs) as app:
        for _ in range(100):  # the first polls: both engines routable
            if httpx.get(app.url + "/ready").status_code == 200:
                break
            time.sleep(0.2)
        for prompt, tokens in zip(PROMPTS, want, strict=True):
            r = httpx.post(app.url + "/v1/completions", timeout=120,
                           headers={"x-pdserve-timings": "1"},
                           json={"model": "smollm2", "prompt": prompt, "max_tokens": 12,
                                 "temperature": 0, "return_token_ids": True})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["token_ids"] == tokens
            timings = body["pdserve_timings"]
            assert timings["decode_wait_s"] > 0 and timings["prefill_compute_s"] > 0, timings
        with httpx.stream("POST", app.url + "/v1/completions", timeout=120, json={
                "model": "smollm2", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
                "stream": True, "return_token_ids": True}) as r:
            lines = [x for x in r.iter_lines() if x.startswith("data: {")]
        streamed = [t for x in lines for t in httpx.Response(200, content=x[6:]).json()
                    ["choices"][0].get("token_ids") or ()]
        assert streamed == want[0]
        # Logprobs: P's for the first token, D's after, ids as vLLM scored them.
        r = httpx.post(app.url + "/v1/completions", timeout=120, json={
            "model": "smollm2", "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0,
            "logprobs": 2, "return_token_ids": True})
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == want[1][:6]
        assert len(choice["logprobs"]["token_logprobs"]) == 6
        assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])
        # A client that goes away mid-stream: D's vLLM request is aborted (vLLM counts
        # no metric for a disconnect's abort; its request log says so).
        with httpx.stream("POST", app.url + "/v1/completions", timeout=120, json={
                "model": "smollm2", "prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            rid = r.headers["x-request-id"]
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 3:
                    break
        procs["decode"].wait_for(rf"Request \S*{re.escape(rid)}\S* aborted", 30)
    # D pulled every PD prompt's KV from P (NIXL): its external prefix-cache hits grew.
    hits = metric(addrs["decode"], "vllm:external_prefix_cache_hits_total") - hits_before
    assert hits >= sum(len(p) - 1 for p in PROMPTS), hits
    # Nothing left running on either engine.
    for address in addrs.values():
        eventually(lambda a=address: metric(a, "vllm:num_requests_running") == 0, 10)
