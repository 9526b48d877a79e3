"""The engine's CPU decode step with its memory on transparent huge pages, against 4 KiB
pages (``pdserve/runtime/huge_pages.py``: ``pdserve engine`` sets
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` for itself).

glibc reads the tunable when a process starts, so each arm is a process of its own:
per round, one child with the tunable and one without (the order alternates from round
to round), each loading the model, prefilling B prompts of ``--prompt-len`` random ids
in one step and timing ``--decode-steps`` decode steps of the whole batch, for each B.
A child reports its median decode step per B and the memory it holds on huge pages
(``AnonHugePages`` of ``/proc/self/smaps_rollup``). The table shows the medians over
rounds and the median of the per-round ratios (4 KiB / huge: above 1 is huge pages
faster); the greedy ids of the two arms must be equal.

    taskset -c 0 .venv/bin/python benchmarks/engine_huge_pages.py            # smollm2, bfloat16
    taskset -c 0 .venv/bin/python benchmarks/engine_huge_pages.py --rounds 2 --batch-sizes 1,8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.runtime.huge_pages import SWITCH, huge_pages_env  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def child(args: argparse.Namespace) -> None:
    """One arm: the decode steps of each batch size in this process (engine_cpu_step's
    engine and round, one engine); JSON on stdout."""
    from benchmarks.engine_cpu_step import build_engine, run_round

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine = build_engine(argparse.Namespace(model=args.model, dtype=args.dtype, threads=1, batch_sizes=sizes,
                                             prompt_len=args.prompt_len, decode_steps=args.decode_steps),
                          prepack=True)
    vocab = engine.model_config.vocab_size
    out = {"decode_ms": {}, "ids": {}}
    for bs in sizes:
        rng = random.Random(bs)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(bs)]
        _, steps, ids = run_round({"arm": engine}, ("arm",), prompts, args.decode_steps, str(bs))["arm"]
        out["decode_ms"][bs] = statistics.median(steps) * 1e3
        out["ids"][bs] = ids
    rollup = Path("/proc/self/smaps_rollup").read_text().splitlines()
    out["huge_mib"], out["rss_mib"] = (next(int(line.split()[1]) // 1024 for line in rollup if line.startswith(key))
                                       for key in ("AnonHugePages", "Rss"))
    print(json.dumps(out))


def run_arm(args: argparse.Namespace, huge: bool) -> dict:
    env = dict(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    env[SWITCH] = "1"
    if huge:
        env = huge_pages_env(env)
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--dtype", args.dtype,
           "--batch-sizes", args.batch_sizes, "--prompt-len", str(args.prompt_len),
           "--decode-steps", str(args.decode_steps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    sizes = args.batch_sizes.split(",")
    got: dict[str, list[dict]] = {"huge": [], "4k": []}
    for rnd in range(args.rounds):
        order = ("huge", "4k") if rnd % 2 == 0 else ("4k", "huge")
        for arm in order:
            got[arm].append(run_arm(args, arm == "huge"))
            row = got[arm][-1]
            print(f"round {rnd} {arm}: " + ", ".join(f"batch {b} {row['decode_ms'][b]:.1f} ms" for b in sizes)
                  + f"; RSS {row['rss_mib']} MiB, {row['huge_mib']} MiB on huge pages", file=sys.stderr, flush=True)
        if got["huge"][-1]["ids"] != got["4k"][-1]["ids"]:
            sys.exit(f"error: round {rnd}: the greedy ids differ between the arms")
    print(f"\nmodel={args.model} dtype={args.dtype} prompt_len={args.prompt_len} "
          f"decode_steps={args.decode_steps} rounds={args.rounds}; greedy ids equal in every round; "
          f"RSS {statistics.median(r['rss_mib'] for r in got['huge'])} MiB with the tunable "
          f"({statistics.median(r['huge_mib'] for r in got['huge'])} MiB on huge pages), "
          f"{statistics.median(r['rss_mib'] for r in got['4k'])} MiB without\n")
    print("| batch | decode step, huge pages ms | 4 KiB pages ms | 4 KiB / huge (min-max) |")
    print("|---:|---:|---:|---:|")
    for b in sizes:
        huge = [r["decode_ms"][b] for r in got["huge"]]
        small = [r["decode_ms"][b] for r in got["4k"]]
        ratios = [s / h for h, s in zip(huge, small, strict=True)]
        print(f"| {b} | {statistics.median(huge):.1f} | {statistics.median(small):.1f} "
              f"| {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
