"""A model's linears on this CPU: torch's plain ``F.linear`` (MKL's GEMM for float32)
against oneDNN with the weight packed once (``torch.ops.mkldnn._reorder_linear_weight``
then ``_linear_pointwise``: what ``pdserve/engine/prepack.py`` does for bfloat16 where
``can_prepack`` allows), per dtype, shape and batch rows.

The shapes are the model's own (q/k/v fused, o, gate/up fused, down, the lm_head), the
rows those of a decode step at batch M (one token a row). Each measurement is the
median time of ``--calls`` calls; the two kernels alternate ``--rounds`` times and the
table shows the median per kernel and the median of the per-round ratios (plain /
packed: above 1, packed is faster). GB/s: the weight's bytes over the time (a decode
step reads every weight once). One thread unless ``--threads``.

Why: which of the two a CPU should run differs by CPU and shape (an AVX2 CPU without
bfloat16 matmuls has ``can_prepack`` false, so its float32 linears take MKL's path);
docs/benchmarks.md, "Linear kernels on an AVX2 CPU", keeps the results.

    taskset -c 0 .venv/bin/python benchmarks/linear_kernels.py
    taskset -c 0 .venv/bin/python benchmarks/linear_kernels.py --dtypes float32 --rows 1,8,32 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.engine.loader import model_config  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="preset or checkpoint (its shapes only)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", default="1,8,32", help="batch rows M of a decode step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    args.dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    args.rows = [int(m) for m in args.rows.split(",")]
    return args


def shapes(name: str) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear of one layer, and the lm_head."""
    cfg = model_config(name)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"qkv": (q + 2 * kv, cfg.hidden_size), "o": (cfg.hidden_size, q),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
            "down": (cfg.hidden_size, cfg.intermediate_size), "lm_head": (cfg.vocab_size, cfg.hidden_size)}


def timed(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{args.model}, {args.threads} thread(s), median of {args.calls} calls, {args.rounds} rounds alternated; "
          f"bfloat16 matmuls in oneDNN: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}\n")
    print("| dtype | linear (out x in) | rows | plain F.linear | oneDNN packed | plain / packed | GB/s plain / packed |")
    print("|---|---|---:|---:|---:|---:|---|")
    with torch.inference_mode():
        for dtype in args.dtypes:
            for label, (n, k) in shapes(args.model).items():
                weight = torch.randn(n, k, dtype=dtype) * 0.02
                try:
                    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
                except RuntimeError as exc:  # e.g. bfloat16 on a CPU without its oneDNN kernels
                    print(f"| {str(dtype).removeprefix('torch.')} | oneDNN cannot pack: {exc} |||||")
                    break
                for m in args.rows:
                    x = torch.randn(m, k, dtype=dtype)
                    arms = {"plain": lambda x=x, w=weight: F.linear(x, w),
                            "packed": lambda x=x, w=packed: torch.ops.mkldnn._linear_pointwise(
                                x, w, None, "none", [], "")}
                    for fn in arms.values():
                        fn()  # first calls: oneDNN builds its kernel
                    got = {arm: [] for arm in arms}
                    for rnd in range(args.rounds):
                        for arm in (("plain", "packed") if rnd % 2 == 0 else ("packed", "plain")):
                            got[arm].append(timed(arms[arm], args.calls))
                    plain, pack = statistics.median(got["plain"]), statistics.median(got["packed"])
                    ratio = statistics.median(a / b for a, b in zip(got["plain"], got["packed"], strict=True))
                    size = weight.numel() * weight.element_size() / 1e9
                    print(f"| {str(dtype).removeprefix('torch.')} | {label} ({n} x {k}) | {m} | "
                          f"{plain * 1e3:.2f} ms | {pack * 1e3:.2f} ms | {ratio:.2f}x | "
                          f"{size / plain:.1f} / {size / pack:.1f} |", flush=True)


if __name__ == "__main__":
    main()
