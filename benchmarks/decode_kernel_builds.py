"""The native decode attention (``pdserve/engine/native/paged_decode.c``) against the same
kernel built from another revision's source, or with other compiler flags, on one core.

Each build runs a layer's decode attention on SmolLM2's shapes (9 query heads, 3 KV
heads, 64 dims, 16-token blocks scattered over the cache) for every ``--batch x
--context``; the builds alternate ``--rounds`` times, each timing the median of
``--calls`` calls; the table shows the median per build and their ratio. Every output is
checked against float64 attention (the largest error is printed: both builds round once
to bfloat16, so it stays within a unit or two of its last place).

With ``--layers N`` each call reads the next of N layers' caches, as the engine's step
does (N = 30: SmolLM2's layers, 200 MB at 32 x 264, past the CPU's caches): the cache is
read from memory, as in the engine, where one layer's weights streamed between two
layers' attention push the cache out. With 1 (the default) it is read hot.

    taskset -c 0 .venv/bin/python benchmarks/decode_kernel_builds.py --against HEAD~1
    taskset -c 0 .venv/bin/python benchmarks/decode_kernel_builds.py --against-flags -mno-avx512bf16
    taskset -c 0 .venv/bin/python benchmarks/decode_kernel_builds.py --against HEAD~1 --layers 30
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine import native  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", help="a git revision whose paged_decode.c is the baseline")
    p.add_argument("--against-flags", default="", help="extra compiler flags of the baseline build")
    p.add_argument("--shapes", default="1x232,8x232,32x264,32x1000", help="batch x context, comma separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--layers", type=int, default=1, help="caches the calls cycle through (30: read cold)")
    return p.parse_args(argv)


def build(source: Path, extra_flags: list[str]) -> native.PagedDecode:
    saved = native.SOURCES, native.FLAGS
    native.SOURCES = (source, *native.SOURCES[1:])  # paged_decode.c first
    native.FLAGS = [*native.FLAGS, *extra_flags]
    try:
        return native.PagedDecode(native.build(Path(tempfile.mkdtemp(prefix="pdserve-kernel-"))))
    finally:
        native.SOURCES, native.FLAGS = saved


def case(rows: int, context: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_row = -(-context // BLOCK)
    num_blocks = rows * blocks_per_row + 8
    k = torch.randn(num_blocks * BLOCK, KV_HEADS, DIM, generator=gen).bfloat16()
    v = torch.randn(num_blocks * BLOCK, KV_HEADS, DIM, generator=gen).bfloat16()
    tables = torch.randperm(num_blocks, generator=gen)[:rows * blocks_per_row].view(rows, -1).contiguous()
    lens = torch.full((rows,), context, dtype=torch.int64)
    q = torch.randn(rows, HEADS, DIM, generator=gen).bfloat16()
    return q, k, v, tables, lens


def reference(q, k, v, tables, lens) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(q.shape[0]):
        slots = (tables[r].repeat_interleave(BLOCK) * BLOCK + torch.arange(BLOCK).repeat(tables.shape[1]))
        slots = slots[:int(lens[r])]
        kk, vv = k[slots].double(), v[slots].double()
        for h in range(HEADS):
            g = h // (HEADS // KV_HEADS)
            p = torch.softmax((kk[:, g] @ q[r, h].double()) * DIM**-0.5, 0)
            out[r, h] = p @ vv[:, g]
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    base_source = native.SOURCES[0]
    if args.against:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.against}:pdserve/engine/native/paged_decode.c"],
                              check=True, capture_output=True, text=True).stdout
        base_source = Path(tempfile.mkdtemp(prefix="pdserve-kernel-src-")) / "paged_decode.c"
        base_source.write_text(text)
    builds = {"current": build(native.SOURCES[0], []),
              "baseline": build(base_source, args.against_flags.split())}
    print(f"baseline: {args.against or 'this source'} {args.against_flags}".rstrip())
    print("\n| batch x context | current us | baseline us | baseline / current | max error current / baseline |")
    print("|---|---:|---:|---:|---|")
    for shape in args.shapes.split(","):
        rows, context = (int(x) for x in shape.split("x"))
        layers = [case(rows, context, seed=rows * 7919 + context + i) for i in range(args.layers)]
        q, k, v, tables, lens = layers[0]
        want = reference(q, k, v, tables, lens)
        errors = {name: (kern(q, k, v, tables, lens, BLOCK, DIM**-0.5, None).double() - want).abs().max().item()
                  for name, kern in builds.items()}
        times: dict[str, list[float]] = {name: [] for name in builds}
        for rnd in range(args.rounds):
            for name in (list(builds) if rnd % 2 == 0 else list(builds)[::-1]):
                kern = builds[name]
                samples = []
                for call in range(args.calls):
                    layer = layers[call % len(layers)]
                    t0 = time.perf_counter()
                    kern(*layer, BLOCK, DIM**-0.5, None)
                    samples.append(time.perf_counter() - t0)
                times[name].append(statistics.median(samples))
        cur, base = (statistics.median(times[n]) * 1e6 for n in ("current", "baseline"))
        print(f"| {rows} x {context} | {cur:,.0f} | {base:,.0f} | {base / cur:.2f}x "
              f"| {errors['current']:.4f} / {errors['baseline']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
