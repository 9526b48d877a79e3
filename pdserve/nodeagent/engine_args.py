"""The engine command line for one instance, built from the PDCluster spec (pure).

Called by the NodeAgent CLI. The engine listens on a free port (``--port 0``) and
prints its address, which the supervisor reads; everything else comes from the
spec so that every instance of a cluster is compatible (block size, dtype,
transport).
"""

from __future__ import annotations

import sys

from pdserve.api import PDCluster
from pdserve.api.common import parse_quantity

ENGINE_ENTRY = [sys.executable, "-m", "pdserve.cli", "engine"]


def build_engine_argv(cluster: PDCluster, role: str, extra: list[str] | None = None) -> list[str]:
    spec = cluster.spec
    model = spec.model.preset or spec.model.path
    if model is None:  # pvc / image sources are mounted by the operator at a fixed path
        model = "/models/" + (spec.model.pvc.sub_path if spec.model.pvc else "")
    engine, kv = spec.engine, spec.kv_transfer
    argv = [*ENGINE_ENTRY, "--model", model, "--role", role, "--port", "0",
            "--dtype", engine.dtype, "--block-size", str(engine.block_size),
            "--max-num-seqs", str(engine.max_num_seqs),
            "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
            "--kv-transport", kv.transport, "--decode-allocation", kv.decode_allocation,
            "--kv-transfer-timeout", f"{kv.timeout_seconds:g}"]
    if engine.num_kv_blocks:
        argv += ["--num-kv-blocks", str(engine.num_kv_blocks)]
    else:
        argv += ["--kv-cache-bytes", str(int(parse_quantity(engine.kv_cache_bytes)))]
    if engine.max_model_len:
        argv += ["--max-model-len", str(engine.max_model_len)]
    if not engine.enable_prefix_caching:
        argv.append("--no-prefix-caching")
    return argv + list(extra or [])


def with_role(argv: list[str], role: str) -> list[str]:
    """``argv`` with its ``--role`` replaced; used when an engine restarts after a switch."""
    out = list(argv)
    if "--role" in out:
        out[out.index("--role") + 1] = role
    else:
        out += ["--role", role]
    return out
