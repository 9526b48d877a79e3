"""What pdserve's Coordinator adds in front of a vLLM server: the same vLLM (hybrid, no
KV connector, core 0) asked directly and through a static Coordinator
(``--engine vllm://...``, core 1), by the same client (``pdserve bench``, core 1),
alternated round by round: output tokens/s, TTFT p50 and ITL p50 per concurrency.

    scripts/vllm-env.sh
    .venv/bin/python benchmarks/vllm_behind_coordinator.py --rounds 2 --concurrency 1,8

Needs 2 cores; vLLM compiles its model at start (about 90 s here). Prints a markdown
table (docs/benchmarks.md keeps the results).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = Path(os.environ.get("PDSERVE_VLLM_MODEL_DIR", Path.home() / ".cache/pdserve/vllm/smollm2-f32"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ok(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"{url} not ready after {timeout_s:g} s")


def bench(url: str, concurrency: int, args, out: Path) -> dict:
    subprocess.run(["taskset", "-c", "1", sys.executable, "-m", "pdserve.cli", "bench",
                    "--base-url", url, "--model", "smollm2", "--concurrency", str(concurrency),
                    "--num-requests", str(args.num_requests), "--prompt-tokens", str(args.prompt_tokens),
                    "--output-tokens", str(args.output_tokens), "--vocab-size", "49152",
                    "--warmup", "2", "--no-progress", "--json", str(out)],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    overall = json.loads(out.read_text())["runs"][0]["overall"]
    return {"tok_s": overall["output_tok_s"], "ttft_p50": overall["ttft_ms"]["p50"],
            "itl_p50": overall["itl_ms"]["p50"], "errors": overall["num_errors"]}


def cells(runs: list[dict], key: str, digits: int) -> str:
    return " / ".join(f"{run[key]:.{digits}f}" for run in runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=64)
    args = p.parse_args()
    vllm_port, coord_port = free_port(), free_port()
    vllm = subprocess.Popen(["bash", "scripts/vllm-serve.sh", "hybrid", str(vllm_port)], cwd=REPO,
                            env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    coordinator = subprocess.Popen(
        ["taskset", "-c", "1", sys.executable, "-m", "pdserve.cli", "coordinator",
         "--engine", f"vllm://127.0.0.1:{vllm_port}?role=hybrid", "--model", str(MODEL_DIR),
         "--served-model-name", "smollm2", "--port", str(coord_port), "--log-level", "WARNING"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    targets = {"vLLM direct": f"http://127.0.0.1:{vllm_port}",
               "through the Coordinator": f"http://127.0.0.1:{coord_port}"}
    results: dict[tuple[str, int], list[dict]] = {}
    try:
        wait_ok(f"http://127.0.0.1:{vllm_port}/health", 600)
        wait_ok(f"http://127.0.0.1:{coord_port}/ready", 60)
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                order = list(targets) if r % 2 == 0 else list(reversed(targets))
                for c in map(int, args.concurrency.split(",")):
                    for name in order:
                        res = bench(targets[name], c, args, Path(tmp) / "out.json")
                        results.setdefault((name, c), []).append(res)
                        print(f"round {r + 1} c={c} {name}: {res}", flush=True)
    finally:
        for proc in (coordinator, vllm):
            os.killpg(proc.pid, 15)
            proc.wait(60)
    print(f"\n{args.prompt_tokens} -> {args.output_tokens} tokens, {args.num_requests} requests per run, "
          f"{args.rounds} rounds alternated\n")
    print("| concurrency | path | output tok/s | TTFT p50 ms | ITL p50 ms | errors |")
    print("|---:|---|---:|---:|---:|---:|")
    for (name, c), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"| {c} | {name} | {cells(runs, 'tok_s', 1)} | {cells(runs, 'ttft_p50', 0)} | "
              f"{cells(runs, 'itl_p50', 1)} | {sum(run['errors'] for run in runs)} |")


if __name__ == "__main__":
    main()
