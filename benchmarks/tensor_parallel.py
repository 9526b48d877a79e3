"""Tensor parallelism on CPU: one engine at TP=2 against the same engine at TP=1, on the
same cores.

Both run the same preset on the same random prompts with greedy decoding, in this
process (rank 0) plus, at TP=2, one worker process. Equal resources: TP=1 gets
``--cores`` torch threads, TP=2 gets ``cores / 2`` threads per rank; TP=1 with
``cores / 2`` threads (``tp1_half``) is reported too, the same threads per process as a
TP=2 rank. Runs alternate (tp1, tp1_half, tp2, tp1, ...) and the median of each metric
over the rounds is reported, so that drift on a shared machine hits all alike.

Definitions, for a batch of B prompts of P tokens and N new tokens each (the token budget
is B×P, so the whole batch prefills in one step):

- prefill tok/s = B×P / TTFT, TTFT from submitting the batch until every request has its
  first token;
- decode tok/s = B×(N−1) / (total − TTFT).

    .venv/bin/python benchmarks/tensor_parallel.py            # about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="pdserve preset")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--cores", type=int, default=2, help="torch threads at TP=1 (split at TP=2)")
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


def run_once(args: argparse.Namespace, tp: int, threads: int, prompts: list[list[int]]) -> dict:
    from pdserve.api.sampling import SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    budget = args.batch * args.prompt_len
    engine = LLMEngine(EngineConfig(
        model=args.model, tensor_parallel_size=tp, num_threads=threads,
        max_num_seqs=args.batch, max_num_batched_tokens=budget, prefill_chunk_tokens=budget,
        enable_prefix_caching=False))
    try:
        params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
        engine.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        start = time.perf_counter()
        reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        ttft = None
        while engine.has_unfinished:
            engine.step()
            if ttft is None and all(r.output_token_ids for r in reqs):
                ttft = time.perf_counter() - start
        total = time.perf_counter() - start
    finally:
        engine.close()
    return {"prefill_tok_s": args.batch * args.prompt_len / ttft,
            "decode_tok_s": args.batch * (args.new_tokens - 1) / (total - ttft),
            "outputs": [r.output_token_ids for r in reqs]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 256) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    half = max(1, args.cores // 2)
    configs = {"tp1": (1, args.cores), "tp1_half": (1, half), "tp2": (2, half)}
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, (tp, threads) in configs.items():
            results[name].append(run_once(args, tp, threads, prompts))
    assert results["tp1"][0]["outputs"] == results["tp2"][0]["outputs"], "TP=2 differs from TP=1"
    summary = {
        name: {metric: round(statistics.median(r[metric] for r in runs), 1)
               for metric in ("prefill_tok_s", "decode_tok_s")}
        for name, runs in results.items()}
    summary["settings"] = vars(args)
    summary["load_average_1m"] = round(os.getloadavg()[0], 1)  # other work on the cores
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
