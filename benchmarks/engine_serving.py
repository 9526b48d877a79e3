"""The engine's serving overhead per output token: a real ``pdserve engine`` process
(the ``tiny`` preset, whose decode step is short enough for the per-token Python around
it to show) serving many streams at once on its session port, as the Coordinator
drives it.

Reports output tokens/s and the engine process's CPU per output token (utime + stime
of every thread, from ``/proc``), for each revision given: ``--compare DIR`` starts
DIR's ``pdserve`` package in turn with this checkout's (A, B, A, B...) on the same load,
and prints the median of each and B / A.

    .venv/bin/python benchmarks/engine_serving.py
    .venv/bin/python benchmarks/engine_serving.py --compare OTHER_CHECKOUT --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.coordinator_overhead import cpu_s  # noqa: E402
from tests.procs import Proc  # noqa: E402


def start_engine(src: Path, max_num_seqs: int) -> tuple[Proc, str]:
    """``pdserve engine`` from ``src``'s package (-P: not from the working directory)."""
    proc = Proc([sys.executable, "-P", "-m", "pdserve.cli", "engine", "--model", "tiny", "--port", "0",
                 "--threads", "1", "--max-num-seqs", str(max_num_seqs), "--log-level", "WARNING"],
                env={"PYTHONPATH": str(src)})
    return proc, proc.wait_for(r"serving model .* on (\S+:\d+)", 120).group(1)


async def drive(address: str, streams: int, tokens: int, seconds: float) -> tuple[int, float]:
    """``streams`` closed-loop requests of ``tokens`` output tokens on one session for
    ``seconds`` (after a warm-up); returns (output tokens, wall seconds)."""
    from pdserve.coordinator.sessions import EmbeddedEngine
    from pdserve.runtime.engine_client import EngineClient, build_generate_request

    session = EmbeddedEngine(EngineClient(address))
    ids = itertools.count()
    produced = 0

    async def stream(stop_at: float) -> None:
        nonlocal produced
        while time.perf_counter() < stop_at:
            call = session.generate(build_generate_request(
                f"r{next(ids)}", prompt_token_ids=[1 + i % 200 for i in range(16)],
                max_tokens=tokens, ignore_eos=True), 60)
            async for message in call:
                produced += len(message.token_ids)

    await asyncio.gather(*(stream(time.perf_counter() + 2) for _ in range(streams)))
    produced, t0 = 0, time.perf_counter()
    await asyncio.gather(*(stream(t0 + seconds) for _ in range(streams)))
    wall = time.perf_counter() - t0
    await session.close()
    return produced, wall


def one_round(src: Path, args) -> tuple[float, float]:
    proc, address = start_engine(src, args.streams)
    try:
        before = cpu_s(proc.popen.pid)
        produced, wall = asyncio.run(drive(address, args.streams, args.tokens, args.seconds))
        used = cpu_s(proc.popen.pid) - before
    finally:
        proc.stop(30)
    return produced / wall, used / produced * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", help="another checkout (A); this one is B")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8)
    args = parser.parse_args()
    sides = {"B": HERE.parent}
    if args.compare:
        sides = {"A": Path(args.compare).resolve(), **sides}
    results: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    print(f"tiny preset, {args.streams} streams of {args.tokens} tokens, {args.seconds:g} s per round")
    for r in range(args.rounds):
        for side, src in sides.items():
            tps, cpu = one_round(src, args)
            results[side].append((tps, cpu))
            print(f"round {r + 1} {side}: {tps:8.0f} output tokens/s  {cpu:6.1f} µs engine CPU per token",
                  flush=True)
    for side, rows in results.items():
        print(f"median {side}: {statistics.median(t for t, _ in rows):8.0f} tokens/s  "
              f"{statistics.median(c for _, c in rows):6.1f} µs per token")
    if args.compare:
        ratios = [b[1] / a[1] for a, b in zip(results["A"], results["B"], strict=True)]
        speed = [b[0] / a[0] for a, b in zip(results["A"], results["B"], strict=True)]
        print(f"B / A: CPU per token {statistics.median(ratios):.2f} "
              f"(rounds {', '.join(f'{x:.2f}' for x in ratios)}), "
              f"tokens/s {statistics.median(speed):.2f}")


if __name__ == "__main__":
    main()
