"""The shared KV pool: time to first token of a prompt another engine computed,
fetched from the pool (Mooncake Store over TCP on loopback) against computed again.

Three engines in this process, one CPU thread each: A computes a prompt (a
1,500-token system prompt and a question), then B (in the pool) and C (not in it)
each get the same prompt; B fetches every full block A put, C computes them all.
Rounds alternate which of B and C goes first; each round has a prompt of its own.

    .venv/bin/python benchmarks/kv_pool.py --rounds 8 --model small
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from pdserve.api.sampling import SamplingParams  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from tests.kv_pool import PoolMaster  # noqa: E402

SYSTEM_TOKENS, QUESTION_TOKENS = 1500, 40


def first_token_s(engine: LLMEngine, rid: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    req = engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while not req.output_token_ids:
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished:
        engine.step()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--model", default="small")
    args = ap.parse_args()
    torch.set_num_threads(1)
    master = PoolMaster().start()
    try:
        def engine(pool: str) -> LLMEngine:
            return LLMEngine(EngineConfig(model=args.model, num_kv_blocks=512, block_size=16,
                                          kv_pool=pool, kv_pool_segment_bytes=1 << 30,
                                          max_num_batched_tokens=2048, num_threads=1))

        a, b, c = engine(master.address), engine(master.address), engine("")
        vocab = a.model_config.vocab_size
        times = {"pool": [], "computed": []}
        for r in range(args.rounds + 1):  # round 0 warms up
            prompt = [(13 * i + 7 * r + 3) % (vocab - 1) + 1
                      for i in range(SYSTEM_TOKENS + QUESTION_TOKENS)]
            first_token_s(a, f"a{r}", prompt)
            a.kv_pool.flush()
            order = [("pool", b), ("computed", c)]
            for name, eng in (order if r % 2 else order[::-1]):
                t = first_token_s(eng, f"{name}{r}", prompt)
                if r:
                    times[name].append(t)
        hits = b.kv_pool.stats.num_hits
        med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        print(f"model {args.model}, {SYSTEM_TOKENS + QUESTION_TOKENS}-token prompts, "
              f"{args.rounds} rounds: TTFT p50 from the pool {med['pool']:.1f} ms, computed "
              f"{med['computed']:.1f} ms ({med['computed'] / med['pool']:.1f}x); "
              f"{hits} blocks fetched, {b.kv_pool.stats.bytes_fetched / 2**20:.1f} MiB")
        for e in (a, b, c):
            e.close()
    finally:
        master.stop()


if __name__ == "__main__":
    main()
