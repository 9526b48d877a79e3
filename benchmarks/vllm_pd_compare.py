"""pdserve over a vLLM P/D pair against vLLM behind its own two-step proxy and against
one vLLM per core, at equal cores (this machine's two), by the same client.

Arms, each on vLLM 0.32 (CPU build, SmolLM2 float32, ``scripts/vllm-serve.sh``):

- ``pdserve PD``: a prefill vLLM on core 0 and a decode vLLM on core 1 (NixlConnector,
  ``kv_buffer_device: cpu``) behind pdserve's Coordinator (static ``--engine
  vllm://...?role=prefill|decode``);
- ``vLLM proxy PD``: the same two vLLMs behind ``benchmarks/vllm_pd_proxy.py``, vLLM's
  documented two-step protocol (P with ``max_tokens: 1``, then D with P's
  ``kv_transfer_params``);
- ``one vLLM per core``: two vLLMs without a KV connector, on cores 0 and 1, behind the
  Coordinator (hybrid; it routes each request to the less loaded one).

The client (``pdserve bench``), the Coordinator and the proxy are not pinned: they share
the two cores with the engines, the same in every arm. Phases go P/D, per-core,
per-core, P/D (each start compiles the model, about 90 s), and inside the P/D phase the
two P/D arms alternate at every point. Every run has its own seed: no run's prompts are
prefix-cache hits for another's. Before each phase's runs, the vLLMs' CPU use while idle
is read over ``--idle-s`` seconds (``/proc``, the process and its children): what
NIXL's progress thread costs with no request in flight.

    scripts/vllm-env.sh
    .venv/bin/python benchmarks/vllm_pd_compare.py --concurrency 1,4,8

Prints a markdown table (docs/benchmarks.md keeps the results).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_behind_coordinator import MODEL_DIR, REPO, free_port, wait_ok  # noqa: E402

NIXL = "NixlConnector"


class Phase:
    """Two vLLMs (``roles``, on cores 0 and 1) and the front ends that serve them."""

    def __init__(self, roles: tuple[str, str], log_dir: Path) -> None:
        self.roles, self.log_dir = roles, log_dir
        self.procs: list[subprocess.Popen] = []
        self.vllms: list[tuple[str, int, int]] = []  # (role, http port, side-channel port)

    def start_vllms(self) -> None:
        for core, role in enumerate(self.roles):
            port, side = free_port(), free_port()
            with open(self.log_dir / f"vllm-{role}-{core}.log", "ab") as log:
                self.procs.append(subprocess.Popen(
                    ["bash", "scripts/vllm-serve.sh", role, str(port)], cwd=REPO,
                    env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "NIXL_PORT": str(side)},
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            self.vllms.append((role, port, side))
        for _, port, _ in self.vllms:
            wait_ok(f"http://127.0.0.1:{port}/health", 900)

    def engine_address(self, role: str, port: int, side: int) -> str:
        if role == "hybrid":
            return f"vllm://127.0.0.1:{port}?role=hybrid"
        return f"vllm://127.0.0.1:{port}?role={role}&kv=127.0.0.1:{side}&connector={NIXL}"

    def start_coordinator(self) -> str:
        port = free_port()
        argv = [sys.executable, "-m", "pdserve.cli", "coordinator", "--model", str(MODEL_DIR),
                "--served-model-name", "smollm2", "--port", str(port), "--log-level", "WARNING"]
        for role, vport, side in self.vllms:
            argv += ["--engine", self.engine_address(role, vport, side)]
        self._spawn(argv, "coordinator")
        wait_ok(f"http://127.0.0.1:{port}/ready", 120)
        return f"http://127.0.0.1:{port}"

    def start_proxy(self) -> str:
        port = free_port()
        argv = [sys.executable, "benchmarks/vllm_pd_proxy.py", "--port", str(port)]
        for role, vport, _ in self.vllms:
            argv += [f"--{role}", f"http://127.0.0.1:{vport}"]
        self._spawn(argv, "proxy")
        wait_ok(f"http://127.0.0.1:{port}/health", 60)
        return f"http://127.0.0.1:{port}"

    def _spawn(self, argv: list[str], name: str) -> None:
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.procs.append(subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))

    def idle_cpu(self, seconds: float) -> list[float]:
        """Each vLLM's CPU seconds per second (its process tree) over ``seconds`` idle."""
        trees = [[p, *p.children(recursive=True)]
                 for p in (psutil.Process(proc.pid) for proc in self.procs[:len(self.vllms)])]

        def used(tree) -> float:
            total = 0.0
            for proc in tree:
                try:
                    t = proc.cpu_times()
                    total += t.user + t.system
                except psutil.NoSuchProcess:
                    pass
            return total

        before = [used(tree) for tree in trees]
        time.sleep(seconds)
        return [(used(tree) - b) / seconds for tree, b in zip(trees, before, strict=True)]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)


def bench(url: str, concurrency: int, seed: int, args, out: Path) -> dict:
    argv = [sys.executable, "-m", "pdserve.cli", "bench", "--base-url", url, "--model", "smollm2",
            "--concurrency", str(concurrency), "--num-requests", str(args.num_requests),
            "--prompt-tokens", args.prompt_tokens, "--output-tokens", args.output_tokens,
            "--vocab-size", "49152", "--seed", str(seed), "--warmup", "2", "--no-progress",
            "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms),
            "--json", str(out)]
    subprocess.run(argv, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    o = json.loads(out.read_text())["runs"][0]["overall"]
    return {"tok_s": o["output_tok_s"], "goodput": o["goodput_rps"], "ok": o["num_ok"],
            "good": o["num_good"], "ttft_p50": o["ttft_ms"]["p50"], "ttft_p90": o["ttft_ms"]["p90"],
            "itl_p50": o["itl_ms"]["p50"], "itl_p99": o["itl_ms"]["p99"],
            "tpot_p50": o["tpot_ms"]["p50"], "errors": o["num_errors"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--prompt-tokens", default="uniform:128:768")
    p.add_argument("--output-tokens", default="64")
    p.add_argument("--slo-ttft-ms", type=float, default=3000)
    p.add_argument("--slo-tpot-ms", type=float, default=100)
    p.add_argument("--idle-s", type=float, default=10)
    p.add_argument("--phases", default="pd,per-core,per-core,pd",
                   help="the order of phases (pd or per-core), each a start of two vLLMs")
    p.add_argument("--log-dir", type=Path, help="the servers' logs (default: a temporary directory)")
    args = p.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="vllm-pd-compare-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, int], list[dict]] = {}
    idle: dict[str, list[float]] = {}
    seed = 1000
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        for round_, kind in enumerate(args.phases.split(",")):
            phase = Phase(("prefill", "decode") if kind == "pd" else ("hybrid", "hybrid"), log_dir)
            try:
                t0 = time.monotonic()
                phase.start_vllms()
                print(f"phase {round_ + 1} ({kind}): vLLMs up in {time.monotonic() - t0:.0f} s",
                      flush=True)
                if kind == "pd":
                    arms = {"pdserve PD": phase.start_coordinator(), "vLLM proxy PD": phase.start_proxy()}
                else:
                    arms = {"one vLLM per core": phase.start_coordinator()}
                label = "with NIXL (P, D)" if kind == "pd" else "without (hybrid, hybrid)"
                idle.setdefault(label, []).extend(phase.idle_cpu(args.idle_s))
                for c in concurrencies:
                    names = list(arms) if round_ % 2 == 0 else list(reversed(arms))
                    for name in names:
                        seed += 1
                        res = bench(arms[name], c, seed, args, out)
                        results.setdefault((name, c), []).append(res)
                        print(f"phase {round_ + 1} c={c} {name}: {res}", flush=True)
            finally:
                phase.stop()
    print(f"\nprompts {args.prompt_tokens} tokens -> {args.output_tokens}, {args.num_requests} requests "
          f"per run, SLO TTFT {args.slo_ttft_ms:g} ms and TPOT {args.slo_tpot_ms:g} ms; "
          f"two runs per cell (' / ')\n")
    print("| concurrency | arm | output tok/s | goodput req/s | TTFT p50 ms | TTFT p90 ms | "
          "ITL p50 ms | ITL p99 ms | errors |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for (name, c), runs in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        row = [" / ".join(f"{run[key]:.{digits}f}" for run in runs) for key, digits in (
            ("tok_s", 1), ("goodput", 2), ("ttft_p50", 0), ("ttft_p90", 0), ("itl_p50", 1), ("itl_p99", 1))]
        print(f"| {c} | {name} | {' | '.join(row)} | {sum(run['errors'] for run in runs)} |")
    print("\nidle CPU per vLLM (CPU s per s):")
    for label, values in idle.items():
        print(f"- {label}: " + ", ".join(f"{v:.2f}" for v in values))
    print(f"\nlogs: {log_dir}")


if __name__ == "__main__":
    main()
