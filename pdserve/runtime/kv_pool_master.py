"""``pdserve kv-pool``: the master of a cluster's shared KV pool (Mooncake Store).

Runs the ``mooncake_master`` the Mooncake wheel ships, in place of this process
(so signals and the exit code are the master's), with the pool's address and its
Prometheus port: ``master_allocated_bytes``, ``master_total_capacity_bytes`` (the
engines' contributed segments) and ``master_key_count`` are the pool's size. Started
by ``pdserve up`` for a spec with ``kvPool.enabled``, and by the operator as the
cluster's ``kv-pool`` Deployment; engines join it with ``--kv-pool HOST:PORT``
(``engine/kv_pool.py``). When memory runs low the master evicts blocks, which the
engines then compute again.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from pdserve.runtime import extras

READY_LINE = "Master service started on port"  # what the master logs once it serves


def master_binary() -> str:
    """The ``mooncake_master`` of this environment (next to its Python, or on PATH)."""
    beside = Path(sys.executable).parent / "mooncake_master"
    found = str(beside) if beside.exists() else shutil.which("mooncake_master")
    if found is None and extras.missing_modules("mooncake"):
        raise SystemExit(f"error: {extras.explain('pdserve kv-pool', 'mooncake')}")
    if found is None:
        raise SystemExit("error: pdserve kv-pool: mooncake_master is neither beside this Python "
                         "nor on PATH (reinstall the mooncake extra)")
    return found


def master_argv(host: str, port: int, metrics_port: int) -> list[str]:
    binary = master_binary()
    return [binary, f"--rpc_address={host}", f"--rpc_port={port}",
            f"--metrics_port={metrics_port}", "--enable_metric_reporting=true"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address the master listens on")
    p.add_argument("--port", type=int, default=50551, help="the pool's port (engines' --kv-pool)")
    p.add_argument("--metrics-port", type=int, default=9003, help="Prometheus metrics port")


def run(args: argparse.Namespace) -> int:
    argv = master_argv(args.host, args.port, args.metrics_port)
    print(f"pdserve kv-pool serving on {args.host}:{args.port}", flush=True)
    os.execv(argv[0], argv)
    return 1  # not reached
