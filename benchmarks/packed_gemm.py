"""The native GEMM over oneDNN's packed bfloat16 weights (``native.PackedGemm``,
``pdserve/engine/native/packed_gemm.c``) against oneDNN's own call on the same packed
weights, as a model's step meets them: every linear of every layer once per pass, so
the weights come from memory, not from a cache warmed by the call before.

For each row count M: one pass is ``--layers`` layers x the model's four projections (q/k/v,
o, gate/up, down), each ``x [M, in] @ W.T``. The two kernels alternate ``--rounds`` times;
per kernel the fastest pass of each round, and the median of the per-round ratios
(oneDNN / native: above 1, the native GEMM is faster). GB/s: the weights' bytes over
the pass. The outputs are checked against oneDNN's first (the share of equal bfloat16
values). One thread unless ``--threads``.

    taskset -c 0 .venv/bin/python benchmarks/packed_gemm.py
    taskset -c 0 .venv/bin/python benchmarks/packed_gemm.py --rows 1,2,4,8,16,32,64,128,256,1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.engine import native, prepack  # noqa: E402
from pdserve.engine.loader import model_config  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="preset or checkpoint (its shapes only)")
    parser.add_argument("--layers", type=int, default=0, help="layers per pass (0: the model's)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,200")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=3, help="per kernel and round")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    args.rows = [int(m) for m in args.rows.split(",")]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not prepack.can_prepack(torch.device("cpu"), torch.bfloat16):
        sys.exit("error: this CPU has no oneDNN bfloat16 matmuls")
    gemm = native.gemm_kernel()
    if gemm is None:
        sys.exit("error: the native GEMM does not run here (see the log: a CPU without AVX-512 BF16?)")
    cfg = model_config(args.model)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = [(q + 2 * kv, cfg.hidden_size), (cfg.hidden_size, q), (2 * cfg.intermediate_size, cfg.hidden_size),
              (cfg.hidden_size, cfg.intermediate_size)]
    layers = args.layers or cfg.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    weights = []
    for _ in range(layers):
        for n, k in shapes:
            plain = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
            packed = torch.ops.mkldnn._reorder_linear_weight(plain)
            if not prepack.gemm_layout_matches(plain, packed):
                sys.exit(f"error: oneDNN packed a {n} x {k} weight in another layout here")
            weights.append(packed)
    size = sum(n * k * 2 for n, k in shapes) * layers / 1e9
    print(f"{args.model}: {layers} layers x {len(shapes)} linears ({size * 1e3:.0f} MB), {args.threads} thread(s), "
          f"{args.rounds} rounds alternated, fastest of {args.passes} passes each\n")
    print("| rows | oneDNN ms | native ms | oneDNN / native (min-max) | GB/s oneDNN / native | outputs equal |")
    print("|---:|---:|---:|---:|---|---:|")
    with torch.inference_mode():
        for m in args.rows:
            xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in {k for _, k in shapes}}
            inputs = [xs[w.shape[1]] for w in weights]
            arms = {"oneDNN": lambda inputs=inputs: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                                     for x, w in zip(inputs, weights, strict=True)],
                    "native": lambda inputs=inputs: [gemm(x, w) for x, w in zip(inputs, weights, strict=True)]}
            first = {arm: fn() for arm, fn in arms.items()}
            equal = statistics.mean((a == b).float().mean().item()
                                    for a, b in zip(first["oneDNN"], first["native"], strict=True))
            got = {arm: [] for arm in arms}
            for rnd in range(args.rounds):
                for arm in (("oneDNN", "native") if rnd % 2 == 0 else ("native", "oneDNN")):
                    best = float("inf")
                    for _ in range(args.passes):
                        t0 = time.perf_counter()
                        arms[arm]()
                        best = min(best, time.perf_counter() - t0)
                    got[arm].append(best)
            ratios = [a / b for a, b in zip(got["oneDNN"], got["native"], strict=True)]
            one, nat = statistics.median(got["oneDNN"]), statistics.median(got["native"])
            print(f"| {m} | {one * 1e3:.2f} | {nat * 1e3:.2f} | {statistics.median(ratios):.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) | {size / one:.1f} / {size / nat:.1f} | {equal:.2%} |",
                  flush=True)


if __name__ == "__main__":
    main()
