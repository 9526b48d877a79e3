"""What grammar-constrained decoding costs the engine (CPU): decode tokens/s of a batch
whose requests are all unconstrained, all constrained by a regex, all constrained by
a JSON Schema, and half and half, on one ``LLMEngine`` with the same prompts.

Each round runs the cases in turn (A, B, C, D, then again), so a slower stretch of the
machine falls on all of them; the table gives each round. Decode tok/s = tokens
generated after each request's first / the time from the batch's first tokens to its
end. A JSON output may be complete before ``--new-tokens`` (it ends "stop"): its batch
then shrinks, which the ``tokens`` column shows. Every case starts after a warm-up request with the same
constraint, so grammar compilation (cached per constraint) is timed separately:
``compile ms`` is the first request's compile, the engine's ``Grammars.start``.

    .venv/bin/python benchmarks/guided_decoding.py            # small preset, batch 8
    .venv/bin/python benchmarks/guided_decoding.py --quick    # tiny preset, a short check
"""

from __future__ import annotations

import argparse
import json
import time

from pdserve.api.sampling import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine

SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "label": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["a", "b", "c"]}}, "required": ["id", "label", "kind"]}}},
    "required": ["items"]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny preset, 32 tokens, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.model, args.new_tokens, args.rounds = "tiny", 32, 1
    return args


def cases(n: int) -> dict[str, tuple[str, str] | None]:
    return {"none": None, "regex": ("regex", f"[a-z ]{{{n + 64}}}"),
            "json_schema": ("json_schema", json.dumps(SCHEMA)), "half": ("regex", f"[a-z ]{{{n + 64}}}")}


def run_batch(engine: LLMEngine, prompts, guided, half: bool, n: int) -> tuple[float, int]:
    params = [SamplingParams(max_tokens=n, ignore_eos=True,
                             guided=None if half and i % 2 else guided)
              for i in range(len(prompts))]
    reqs = [engine.add_request(f"b-{time.monotonic_ns()}-{i}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    first_s = None
    while engine.has_unfinished:
        engine.step()
        if first_s is None and all(r.output_token_ids for r in reqs):
            first_s = time.perf_counter()
    elapsed = time.perf_counter() - first_s
    return elapsed, sum(len(r.output_token_ids) - 1 for r in reqs)


def main() -> None:
    args = parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.threads,
                                    max_num_seqs=max(8, args.batch)))
    prompts = [list(f"Request {i}: write something. ".encode()) for i in range(args.batch)]
    compile_ms = {}
    for guided in cases(args.new_tokens).values():
        if guided is not None and guided not in compile_ms:
            start = time.perf_counter()
            engine.grammars.start(*guided, [])
            compile_ms[guided] = (time.perf_counter() - start) * 1e3
        engine.generate([prompts[0]], SamplingParams(max_tokens=4, guided=guided))  # warm
    print(f"model={args.model} batch={args.batch} new_tokens={args.new_tokens} "
          f"threads={args.threads}")
    print("| round | case | tokens | decode tok/s | vs none | compile ms |")
    print("|---:|---|---:|---:|---:|---:|")
    for rnd in range(args.rounds):
        base = None
        for name, guided in cases(args.new_tokens).items():
            elapsed, tokens = run_batch(engine, prompts, guided, name == "half", args.new_tokens)
            rate = tokens / elapsed
            base = rate if name == "none" else base
            comp = f"{compile_ms[guided]:.1f}" if guided is not None else "-"
            print(f"| {rnd + 1} | {name} | {tokens} | {rate:,.0f} | {rate / base:.2f}x | {comp} |",
                  flush=True)


if __name__ == "__main__":
    main()
