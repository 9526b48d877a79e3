"""The engine's CPU step tricks, each against what it replaced, in one process.

1. Linear weights packed for oneDNN against plain ``F.linear``: two ``LLMEngine``s on
the same model and dtype, one with ``prepack_weights`` (``pdserve/engine/prepack.py``)
and one without. For each batch size B, each round gives both engines the same B
prompts of ``--prompt-len`` random token ids, prefilled in one step each (the token
budget is raised to B×P), then runs ``--decode-steps`` decode steps of the whole batch
on each, the two engines' steps interleaved; which engine goes first alternates from
round to round. Per round and engine: the prefill step's time and the median decode
step; the table shows the median over rounds and the median of the per-round ratios
(plain / packed: above 1 is packed faster). The greedy token ids of the two engines
must be equal (checked every round).

With ``--against plain-head`` the other engine is packed too, but multiplies by the
plain tied embedding for its logits, as before the tied head got a packed copy of its
own: the head's share alone. With ``--against eager`` both are packed, and the first
one's prefill steps run compiled (``pdserve/engine/compiled.py``) against the other's
eager ones (greedy ids are reported, not required equal: see compiled.py). With
``--against gather`` the first one's decode attention reads the paged cache in place
(``pdserve/engine/native``) against the other's gather and SDPA. With ``--against onednn``
both are packed, and the first one's steps of a few rows multiply by the packed weights
in the native GEMM (``native.PackedGemm``) against the other's oneDNN for every linear.
With ``--against elementwise`` both are packed, and the first one's eager steps take the
native norms and rotary (``native.Elementwise``) against the other's torch ops.

2. The greedy pick (``sampler.argmax``: ``max``'s indices) against ``Tensor.argmax``
over float32 logits of the model's vocabulary, B rows: the fastest of 30 alternated
calls each.

Only ratios within one run compare on a shared machine.

    taskset -c 0 .venv/bin/python benchmarks/engine_cpu_step.py              # smollm2, bfloat16
    taskset -c 0 .venv/bin/python benchmarks/engine_cpu_step.py --quick      # a short check
    taskset -c 0 .venv/bin/python benchmarks/engine_cpu_step.py --against plain-head
    taskset -c 0 .venv/bin/python benchmarks/engine_cpu_step.py --against eager --batch-sizes 1,4 --prompt-len 400
    taskset -c 0 .venv/bin/python benchmarks/engine_cpu_step.py --against gather --decode-steps 32
    taskset -c 0 .venv/bin/python benchmarks/engine_cpu_step.py --against onednn --rounds 3
    taskset -c 0 .venv/bin/python benchmarks/engine_cpu_step.py --against elementwise --rounds 3
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.api.sampling import SamplingParams  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.model import use_native  # noqa: E402
from pdserve.engine.sampler import argmax  # noqa: E402

BLOCK_SIZE = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="preset or checkpoint")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--against", default="plain", choices=["plain", "plain-head", "eager", "gather", "onednn", "elementwise"],
                        help="the other engine: no packing, or packed with the tied head plain")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8, 2 rounds, 8 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.rounds, args.decode_steps = "1,8", 2, 8
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    return args


def build_engine(args: argparse.Namespace, prepack: bool, compile_prefill: bool = False) -> LLMEngine:
    max_bs = max(args.batch_sizes)
    seq_len = args.prompt_len + args.decode_steps + 1
    return LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype, num_threads=args.threads, block_size=BLOCK_SIZE,
        num_kv_blocks=max_bs * math.ceil(seq_len / BLOCK_SIZE), max_num_seqs=max_bs,
        max_num_batched_tokens=max_bs * args.prompt_len, prefill_chunk_tokens=max_bs * args.prompt_len,
        enable_prefix_caching=False, prepack_weights=prepack, compile_prefill=compile_prefill,
    ))


def run_round(engines: dict[str, LLMEngine], order: tuple[str, ...], prompts: list[list[int]],
              decode_steps: int, tag: str):
    """One round of a batch on every engine: the prefill steps one after the other, then
    the decode steps interleaved (a step of one engine, a step of the other), so that a
    slow moment of a shared machine falls on both. Per engine: (prefill step s, decode
    step times s, output token ids)."""
    params = SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True)
    reqs = {arm: [engines[arm].add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
            for arm in order}
    prefill_s, steps = {}, {arm: [] for arm in order}
    for arm in order:
        t0 = time.perf_counter()
        engines[arm].step()
        prefill_s[arm] = time.perf_counter() - t0
        assert all(len(r.output_token_ids) == 1 for r in reqs[arm]), "the prefill took more than one step"
    for _ in range(decode_steps):
        for arm in order:
            t0 = time.perf_counter()
            engines[arm].step()
            steps[arm].append(time.perf_counter() - t0)
    assert not any(e.has_unfinished for e in engines.values())
    return {arm: (prefill_s[arm], steps[arm], [r.output_token_ids for r in reqs[arm]]) for arm in order}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    base = args.against
    engines = {"packed": build_engine(args, True, base == "eager"),
               base: build_engine(args, base in ("plain-head", "eager", "gather", "onednn", "elementwise"))}
    if base == "gather":
        if engines["packed"].runner.decode_kernel is None:
            sys.exit("error: the native decode kernel is not available (see the log)")
        engines[base].runner.decode_kernel = None  # gather the KV, then SDPA
    if base == "onednn":
        if not any(hasattr(p, "gemm") for p in engines["packed"].runner.model.parameters()):
            sys.exit("error: no weight is read by the native GEMM (see the log: prepack)")
        for p in engines[base].runner.model.parameters():
            p.__dict__.pop("gemm", None)  # every linear through oneDNN
    if base == "elementwise":
        if engines["packed"].runner.model.norm.native is None:
            sys.exit("error: the native elementwise kernels are not available (see the log)")
        use_native(engines[base].runner.model, None)  # torch's ops
    if base == "eager" and engines["packed"].runner.model.compiled is None:
        sys.exit("error: the prefill was not compiled (see the log: compiled.can_compile)")
    if base == "plain-head":
        if not engines[base].model_config.tie_word_embeddings:
            sys.exit("error: --against plain-head needs a model with a tied head")
        engines[base].runner.model.lm_head = None  # the logits from the plain embedding
    arms = ("packed", base)
    num_packed = sum(p.is_mkldnn for p in engines["packed"].runner.model.parameters())
    if num_packed == 0:
        sys.exit(f"error: nothing was packed (device cpu, dtype {args.dtype}: prepack.can_prepack)")
    vocab = engines[base].model_config.vocab_size
    run_round(engines, arms, [[1] * 32, [2] * 32], 2, "warm")  # first calls of every kernel
    rows, differed = [], 0
    for bs in args.batch_sizes:
        rng = random.Random(bs)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(bs)]
        got = {arm: {"prefill": [], "decode": []} for arm in arms}
        for rnd in range(args.rounds):
            done = run_round(engines, arms if rnd % 2 == 0 else arms[::-1], prompts,
                             args.decode_steps, f"{bs}-{rnd}")
            for arm, (prefill_s, steps, _) in done.items():
                got[arm]["prefill"].append(prefill_s)
                got[arm]["decode"].append(statistics.median(steps))
            if done["packed"][2] != done[base][2]:
                if base not in ("eager", "gather", "onednn", "elementwise"):
                    sys.exit(f"error: batch {bs} round {rnd}: the packed engine's greedy ids differ")
                # Compiled sums in another order: random-id prompts put near-ties in the argmax.
                differed += 1
                same = sum(a == b for a, b in zip(done["packed"][2], done[base][2], strict=True))
                print(f"batch {bs} round {rnd}: {same}/{bs} prompts' greedy ids equal to eager's "
                      f"(first tokens equal: {all(a[0] == b[0] for a, b in zip(done['packed'][2], done[base][2], strict=True))})",
                      file=sys.stderr, flush=True)
            print(f"batch {bs} round {rnd}: decode step packed "
                  f"{got['packed']['decode'][-1] * 1e3:.1f} ms, {base} {got[base]['decode'][-1] * 1e3:.1f}"
                  f" ms; prefill packed {got['packed']['prefill'][-1] * 1e3:.0f} ms, {base} "
                  f"{got[base]['prefill'][-1] * 1e3:.0f} ms", file=sys.stderr, flush=True)
        row = {"batch": bs}
        for what in ("decode", "prefill"):
            for arm in arms:
                row[f"{arm}_{what}_ms"] = statistics.median(got[arm][what]) * 1e3
            ratios = [b / a for a, b in zip(got["packed"][what], got[base][what], strict=True)]
            row[f"{what}_ratio"] = statistics.median(ratios)
            row[f"{what}_ratio_range"] = (min(ratios), max(ratios))
        rows.append(row)
    print(f"\nmodel={args.model} dtype={args.dtype} threads={args.threads} prompt_len={args.prompt_len}"
          f" decode_steps={args.decode_steps} rounds={args.rounds}; {num_packed} weights packed; "
          + (f"greedy ids differed in {differed} rounds\n" if differed else "greedy ids equal in every round\n"))
    print(f"| batch | decode step packed ms | {base} ms | {base} / packed (min-max) "
          f"| prefill packed ms | {base} ms | {base} / packed (min-max) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['packed_decode_ms']:.1f} | {r[f'{base}_decode_ms']:.1f} "
              f"| {r['decode_ratio']:.2f}x ({r['decode_ratio_range'][0]:.2f}-{r['decode_ratio_range'][1]:.2f}) "
              f"| {r['packed_prefill_ms']:,.0f} | {r[f'{base}_prefill_ms']:,.0f} "
              f"| {r['prefill_ratio']:.2f}x ({r['prefill_ratio_range'][0]:.2f}-{r['prefill_ratio_range'][1]:.2f}) |")
    time_greedy_pick(args.batch_sizes, vocab)


def time_greedy_pick(batch_sizes: list[int], vocab: int) -> None:
    import torch

    print("\n| batch | Tensor.argmax us | sampler.argmax us | ratio |")
    print("|---:|---:|---:|---:|")
    for bs in batch_sizes:
        logits = torch.randn(bs, vocab)
        best = {"argmax": math.inf, "max": math.inf}
        for _ in range(30):
            for name, pick in (("argmax", lambda x: x.argmax(-1)), ("max", argmax)):
                t0 = time.perf_counter()
                pick(logits)
                best[name] = min(best[name], time.perf_counter() - t0)
        print(f"| {bs} | {best['argmax'] * 1e6:,.0f} | {best['max'] * 1e6:,.0f} "
              f"| {best['argmax'] / best['max']:.2f}x |")


if __name__ == "__main__":
    main()
