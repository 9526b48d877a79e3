"""The engine command line for one instance, built from the PDCluster spec (pure).

Called by the NodeAgent CLI. The engine listens on a free port (``--port 0``) and
prints its address, which the supervisor reads; everything else comes from the
spec so that every instance of a cluster is compatible (block size, dtype,
transport): the cluster-wide engine settings, plus the instance's *pool* settings
(``threads``, ``parallelism.tensorParallelSize``; ``cpuAffinity`` is applied by the
supervisor, not on the command line). A hybrid-pool engine never takes a leg of a
disaggregated request, so where a transport could not carry its KV (tensor parallelism,
GPUs) it runs without one.
"""

from __future__ import annotations

import sys

from pdserve.api import PDCluster
from pdserve.api.common import parse_quantity
from pdserve.api.component_args import model_location
from pdserve.api.instance import Pool

ENGINE_ENTRY = [sys.executable, "-m", "pdserve.cli", "engine"]


def build_engine_argv(cluster: PDCluster, pool: Pool, extra: list[str] | None = None) -> list[str]:
    """The argv of an engine of ``pool``, which also starts in the pool's role
    (``with_role`` changes it after a switch); ``extra`` flags go last and win."""
    spec = cluster.spec
    engine, kv, pool_spec = spec.engine, spec.kv_transfer, getattr(spec, pool)
    tp = pool_spec.parallelism.tensor_parallel_size
    transport = "none" if pool == "hybrid" and (tp > 1 or pool_spec.gpus) else kv.transport
    argv = [*ENGINE_ENTRY, "--model", model_location(spec), "--role", pool, "--port", "0",
            "--dtype", engine.dtype, "--block-size", str(engine.block_size),
            "--max-num-seqs", str(engine.max_num_seqs),
            "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
            "--kv-transport", transport, "--decode-allocation", kv.decode_allocation,
            "--kv-transfer-timeout", f"{kv.timeout_seconds:g}"]
    if transport == "mooncake":
        argv += ["--kv-mooncake-protocol", kv.mooncake.protocol]
        if kv.mooncake.devices:
            argv += ["--kv-mooncake-devices", ",".join(kv.mooncake.devices)]
    if engine.num_kv_blocks:
        argv += ["--num-kv-blocks", str(engine.num_kv_blocks)]
    else:
        argv += ["--kv-cache-bytes", str(int(parse_quantity(engine.kv_cache_bytes)))]
    if engine.max_model_len:
        argv += ["--max-model-len", str(engine.max_model_len)]
    if not engine.enable_prefix_caching:
        argv.append("--no-prefix-caching")
    if engine.prefill_chunk_tokens:
        argv += ["--prefill-chunk-tokens", str(engine.prefill_chunk_tokens)]
    if pool_spec.threads:
        argv += ["--threads", str(pool_spec.threads)]
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp)]
    if engine.simulate is not None:
        argv += engine.simulate.engine_flags()
    if spec.kv_pool.enabled:  # the pool's address comes with extra (--kv-pool): local or a Service
        argv += ["--kv-pool-segment-mib", str(int(parse_quantity(spec.kv_pool.segment_size)) >> 20)]
    return argv + list(extra or [])


def with_role(argv: list[str], role: str) -> list[str]:
    """``argv`` with its ``--role`` replaced; used when an engine restarts after a switch."""
    out = list(argv)
    if "--role" in out:
        out[out.index("--role") + 1] = role
    else:
        out += ["--role", role]
    return out
