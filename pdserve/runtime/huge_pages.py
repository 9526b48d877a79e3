"""The engine's process on transparent huge pages: glibc's malloc asked to back its
memory with 2 MiB pages (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``).

Why: a CPU decode step streams every weight from DRAM once (SmolLM2 in bfloat16: 270
MB a step, about 70% of a batch-1 step). With 4 KiB pages the hardware prefetcher
stops at every page boundary and each page costs a TLB walk; on 2 MiB pages the same
step measured about 1.1x faster (docs/benchmarks.md, "Weights on huge pages"). Most
weights are allocated one by one under glibc's mmap threshold's reach (a packed
SmolLM2 projection is 0.7-3.5 MB), which torch's own ``THP_MEM_ALLOC_ENABLE`` (2 MiB
alignment only from 2 MiB up) misses; glibc's tunable covers its heap and every mapped
chunk.

How: glibc reads its tunables once, when the process starts, so ``pdserve engine``
re-executes itself (same pid, arguments, open files, CPU affinity) with the tunable
added, before it imports torch or loads anything (``reexec_with_huge_pages``; called
by ``pdserve.cli.main`` for a real, not simulated, engine). Off with
``PDSERVE_HUGE_PAGES=0``. Where the kernel's THP mode is ``never``, or glibc is not
the C library, the tunable is ignored and nothing changes. Tensor-parallel workers
inherit the environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb=1"
SWITCH = "PDSERVE_HUGE_PAGES"


def huge_pages_env(environ: Mapping[str, str]) -> dict[str, str] | None:
    """``environ`` with the tunable added; None when it is there already (this process
    was re-executed, or the user set it) or ``PDSERVE_HUGE_PAGES=0`` turns it off."""
    if environ.get(SWITCH, "1") == "0":
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" in tunables:  # ours, or the user's own choice
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}" if tunables else TUNABLE}


def _is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):  # a C library that does not know the name (musl)
        return False


def reexec_with_huge_pages() -> None:
    """Replace this process by itself with the tunable set (no return), unless
    ``huge_pages_env`` says there is nothing to add or the platform has no glibc."""
    if not sys.platform.startswith("linux") or not _is_glibc():
        return
    env = huge_pages_env(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
