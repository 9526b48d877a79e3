"""Command-line flags shared by ``pdserve engine`` and ``pdserve generate``."""

from __future__ import annotations

import argparse

from pdserve.api.common import bytes_arg
from pdserve.engine.config import DTYPES, ROLES, EngineConfig
from pdserve.engine.sim import SimTiming

# The KV transfer's deadlines: flag, EngineConfig field (the default), help.
KV_DEADLINES = (
    ("--kv-transfer-timeout", "kv_transfer_timeout_s", "one batch of KV writes or reads may take this long"),
    ("--kv-descriptor-timeout", "kv_descriptor_timeout_s", "P waits this long for D's destination blocks"),
    ("--kv-done-timeout", "kv_done_timeout_s",
     "D waits this long for the KV from admission (above --kv-descriptor-timeout)"),
    ("--kv-lease", "kv_lease_s", "pull mode: P holds prefilled blocks this long for D to read"),
    ("--kv-abort-ack-timeout", "kv_abort_ack_timeout_s",
     "D keeps reserved blocks this long after an abort, waiting for P to confirm"),
    ("--kv-reserve-wait-s", "kv_reserve_wait_s", "D waits this long for free KV blocks, then "
     "refuses the leg with RESOURCE_EXHAUSTED 'decode full' (below --kv-descriptor-timeout)"),
)

# The simulated engine's timing model: flag, SimTiming field, unit (seconds per flag unit), help.
SIM_TIMINGS = (
    ("--sim-prefill-base-ms", "prefill_base_s", 1e-3, "fixed time of a step that prefills"),
    ("--sim-prefill-per-token-ms", "prefill_per_token_s", 1e-3, "time per prompt token prefilled"),
    ("--sim-decode-base-ms", "decode_base_s", 1e-3, "fixed time of a decode-only step"),
    ("--sim-decode-per-seq-ms", "decode_per_seq_s", 1e-3, "time per request decoded in a step"),
    ("--sim-decode-per-kv-token-us", "decode_per_kv_token_s", 1e-6,
     "time per token of context the step's decodes hold"),
)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag has a help text, so ``--help`` (``pdserve.cli.HelpFormatter``) shows
    its default."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="tiny", help="preset name (tiny, small) or a local HF checkpoint dir")
    g.add_argument("--device", default="cpu", help="cpu | cuda[:N] | npu[:N]")
    g.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="weights and KV cache dtype; auto: the checkpoint's (float32 for GGUF files "
                        "and random presets)")
    g.add_argument("--role", default="hybrid", choices=ROLES,
                   help="prefill or decode (one leg of a disaggregated request), or hybrid (both)")
    g.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV cache block (a power of two; P and D must agree)")
    g.add_argument("--kv-cache-bytes", type=bytes_arg, default=256 * 2**20,
                   help="KV cache budget in bytes, or a size as in the spec (20Gi, 512Mi)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (wins over bytes)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests in the running batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step (decodes and prefill chunks together)")
    g.add_argument("--prefill-chunk-tokens", type=int, default=512,
                   help="most prompt tokens one step prefills, all requests together")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="most tokens per request (default: the model's context length)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="do not share KV blocks between requests with the same prompt prefix")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's); per rank with tensor parallelism")
    g.add_argument("--no-prepack-weights", dest="prepack_weights", action="store_false",
                   help="keep linear weights plain (by default they are packed for oneDNN at load "
                        "on a CPU with bfloat16 matmuls, when --dtype is bfloat16)")
    g.add_argument("--no-compile-prefill", dest="compile_prefill", action="store_false",
                   help="run prefill steps eager (by default their dense parts are compiled at start "
                        "on CPU in bfloat16 with packed weights; PDSERVE_COMPILE=0 does the same)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (processes, one device each: cuda:N+rank) the model's heads and "
                   "MLP are split over; above 1 only for a hybrid engine with --kv-transport none")
    s = parser.add_argument_group("simulation (--simulate)")
    s.add_argument("--simulate", action="store_true",
                   help="replace the model by a timing model: steps sleep for the modelled time "
                        "and generate a fixed text; the server, scheduler, KV cache bookkeeping "
                        "and KV transfer are real (control-plane tests at scale)")
    for flag, name, unit, text in SIM_TIMINGS:
        s.add_argument(flag, type=float, default=getattr(SimTiming, name) / unit, help=text)
    k = parser.add_argument_group("KV transfer")
    k.add_argument("--kv-transport", default="tcp", choices=("tcp", "shm", "mooncake", "nixl", "none"),
                   help="how KV moves between engines (shm: same node only; none: no disaggregation)")
    k.add_argument("--kv-host", default="127.0.0.1", help="address peers reach the KV transport on")
    k.add_argument("--kv-port", type=int, default=0, help="KV transport port (0: a free one)")
    k.add_argument("--kv-auth-token", default=None,
                   help="shared secret peers must present (default: the cluster token)")
    k.add_argument("--decode-allocation", default="dispatch", choices=("dispatch", "prefill_complete"),
                   help="when D reserves destination blocks: at admission, or once P's prefill is done")
    k.add_argument("--no-kv-partial-transfer", dest="kv_partial_transfer", action="store_false",
                   help="D receives a prompt's whole KV even when its prefix cache holds the start")
    k.add_argument("--kv-mooncake-protocol", default="tcp", choices=("tcp", "rdma"),
                   help="Mooncake transport's protocol (rdma needs an RDMA NIC)")
    k.add_argument("--kv-mooncake-devices", default="", metavar="NAMES",
                   help="RDMA devices Mooncake uses, comma-separated (e.g. mlx5_0,mlx5_1)")
    k.add_argument("--kv-pool", default="", metavar="HOST:PORT",
                   help="share prefix KV blocks through the Mooncake Store master at HOST:PORT")
    k.add_argument("--kv-pool-segment-mib", type=int, default=256,
                   help="memory this engine contributes to the KV pool")
    for flag, field, text in KV_DEADLINES:
        k.add_argument(flag, type=float, dest=field, default=getattr(EngineConfig, field),
                       metavar="SECONDS", help=text)
    k.add_argument("--fault-kv-send-delay", type=float, default=0.0,
                   help="fault injection: delay each KV write job (seconds; tests and drills)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, role=args.role,
        block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, num_threads=args.threads,
        prepack_weights=args.prepack_weights, compile_prefill=args.compile_prefill,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_transport=args.kv_transport, kv_host=args.kv_host, kv_port=args.kv_port,
        kv_auth_token=args.kv_auth_token, decode_allocation=args.decode_allocation,
        kv_partial_transfer=args.kv_partial_transfer, kv_pool=args.kv_pool,
        kv_mooncake_protocol=args.kv_mooncake_protocol,
        kv_mooncake_devices=args.kv_mooncake_devices,
        kv_pool_segment_bytes=args.kv_pool_segment_mib << 20,
        fault_kv_send_delay_s=args.fault_kv_send_delay,
        simulate=SimTiming(**{name: getattr(args, _dest(flag)) * unit
                              for flag, name, unit, _ in SIM_TIMINGS}) if args.simulate else None,
        **{field: getattr(args, field) for _, field, _ in KV_DEADLINES},
    )


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")
