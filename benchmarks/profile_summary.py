"""Where a process's time goes, from py-spy's collapsed stacks (``py-spy record --format raw``).

Each line of the input is one stack, outermost frame first, frames ``function
(file:line)`` separated by ``;``, then the number of samples; recorded with
``--threads``, the first frame is ``thread (TID): NAME``, and ``--thread TID`` keeps only
that thread's stacks (a process's main thread has its pid as TID). py-spy samples
the threads that are not idle, so these are shares of the thread's busy time.
Printed, as shares of the samples kept:

  by package   self time grouped by the leaf frame's package (asyncio, grpc, uvicorn,
               starlette, fastapi, pydantic, pdserve's modules, ...)
  inclusive    functions by the samples whose stack contains them (counted once per
               stack): what each call costs with everything it calls
  self         functions by the samples where they are the leaf

Called by ``benchmarks/coordinator_overhead.py --profile``; also by hand:
.venv/bin/python benchmarks/profile_summary.py STACKS.txt [--thread TID] [--top N]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def split_frame(frame: str) -> tuple[str, str]:
    m = FRAME.match(frame)
    return (m["func"], m["file"]) if m else (frame, "")


def package(file: str) -> str:
    """``pdserve/coordinator/legs.py`` -> ``pdserve.coordinator.legs``; a library file
    -> its top-level package (``grpc/aio/_call.py`` -> ``grpc``)."""
    parts = file.removesuffix(".py").split("/")
    if parts[0] == "pdserve":
        return ".".join(parts)
    if parts[0].startswith("<frozen"):
        return "python (frozen)"
    return parts[0] or "native"


def read(path: str, thread: str | None = None) -> list[tuple[list[str], int]]:
    """The stacks of ``path`` (of thread ``thread`` only, its frame dropped, if given)."""
    stacks = []
    with open(path) as f:
        for line in f:
            frames, _, count = line.rstrip("\n").rpartition(" ")
            if not frames or not count.isdigit():
                continue
            names = frames.split(";")
            if thread is not None:
                if names[0].partition(":")[0] != f"thread ({thread})" or len(names) == 1:
                    continue
                names = names[1:]
            stacks.append((names, int(count)))
    return stacks


def summarize(stacks: list[tuple[list[str], int]], top: int) -> str:
    total = sum(n for _, n in stacks) or 1
    by_package: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    for frames, n in stacks:
        names = [f"{func} ({file})" for func, file in map(split_frame, frames)]
        by_package[package(split_frame(frames[-1])[1])] += n
        leaf[names[-1]] += n
        for name in set(names):
            inclusive[name] += n
    lines = [f"{total} samples"]
    for title, counter in (("by package (self)", by_package), ("inclusive", inclusive),
                           ("self", leaf)):
        lines.append(f"\n{title}:")
        lines += [f"  {n / total:6.1%}  {name}" for name, n in counter.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stacks")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--thread", default=None, metavar="TID", help="only this thread's stacks")
    args = ap.parse_args()
    print(summarize(read(args.stacks, args.thread), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
