"""The vLLM command line and environment of one instance, from the PDCluster spec (pure).

Called by ``launch.VllmLaunch`` at each launch (the role may have changed, the ports
are new). vLLM's OpenAI server gets the spec's command (``spec.engine.vllm.command``),
the model, the listen address the agent chose, the engine settings vLLM has, and in
the prefill and decode roles its KV connector as producer or consumer, whose side
channel listens on ``side_channel`` (``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``), and
its prefix-cache events published over ZMQ (``--kv-events-config``) for the
Coordinators' prefix routing.

Mapped: ``dtype``, ``maxModelLen``, ``maxNumSeqs``, ``maxNumBatchedTokens``,
``enablePrefixCaching``, ``kvCacheBytes`` (``--kv-cache-memory-bytes``, CPU and GPU
alike), ``numKvBlocks`` (``--num-gpu-blocks-override``), ``tensorParallelSize``, the
served model name; the engine's cores (``cpuAffinity``) as ``VLLM_CPU_OMP_THREADS_BIND``.
Not mapped: ``blockSize`` (vLLM picks its own per device; P and D must agree, which
the compat hash checks), ``threads`` (vLLM runs one OpenMP thread per bound core).
The spec's ``extraArgs`` and ``env`` come last and win.
"""

from __future__ import annotations

import json

from pdserve.api import PDCluster
from pdserve.api.common import parse_quantity
from pdserve.api.component_args import model_location
from pdserve.api.instance import Pool

KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# The line vLLM's uvicorn prints once the server accepts requests.
READY_LINE = "Application startup complete"


def kv_transfer_config(cluster: PDCluster, pool: Pool, role: str) -> dict | None:
    """The ``--kv-transfer-config`` of an engine in ``role`` (None for hybrid)."""
    if role not in KV_ROLES:
        return None
    return {"kv_connector": cluster.spec.engine.vllm.kv_connector, "kv_role": KV_ROLES[role],
            "kv_buffer_device": "cuda" if getattr(cluster.spec, pool).gpus else "cpu"}


def build_vllm_argv(cluster: PDCluster, pool: Pool, role: str, host: str, port: int,
                    events_port: int = 0) -> list[str]:
    """``events_port``: where its prefix-cache events are published (ZMQ, every
    address), with prefix caching on; 0: not published."""
    spec = cluster.spec
    engine, pool_spec = spec.engine, getattr(spec, pool)
    argv = [*engine.vllm.command, "--model", model_location(spec),
            "--served-model-name", spec.model.served_name or cluster.metadata.name,
            "--host", host, "--port", str(port),
            "--max-num-seqs", str(engine.max_num_seqs),
            "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
            # what the Coordinator reads of a request: P's queue and prefill times, cached tokens
            "--enable-per-request-metrics", "--enable-prompt-tokens-details"]
    if engine.dtype != "auto":
        argv += ["--dtype", engine.dtype]
    if engine.max_model_len:
        argv += ["--max-model-len", str(engine.max_model_len)]
    if not engine.enable_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    elif events_port:
        argv += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}"},
            separators=(",", ":"))]
    if engine.num_kv_blocks:
        argv += ["--num-gpu-blocks-override", str(engine.num_kv_blocks)]
    else:
        argv += ["--kv-cache-memory-bytes", str(int(parse_quantity(engine.kv_cache_bytes)))]
    if (tp := pool_spec.parallelism.tensor_parallel_size) > 1:
        argv += ["--tensor-parallel-size", str(tp)]
    if (config := kv_transfer_config(cluster, pool, role)) is not None:
        argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
    return argv + list(engine.vllm.extra_args)


def cpu_list(cpus: tuple[int, ...]) -> str:
    """Cores as a Linux cpulist ("0-3,6"), as ``VLLM_CPU_OMP_THREADS_BIND`` reads it."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def vllm_env(cluster: PDCluster, pool: Pool, side_channel: tuple[str, int],
             cpus: tuple[int, ...]) -> dict[str, str]:
    """What vLLM's environment adds to the agent's: the KV side channel, the cores its
    OpenMP threads bind to (pinned engines; else no binding), then the spec's ``env``."""
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": side_channel[0],
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel[1]),
           "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus) if cpus else "nobind"}
    if not getattr(cluster.spec, pool).gpus:
        env["VLLM_TARGET_DEVICE"] = "cpu"
    return env | dict(cluster.spec.engine.vllm.env)
