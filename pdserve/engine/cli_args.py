"""Command-line flags shared by ``pdserve engine`` and ``pdserve generate``."""

from __future__ import annotations

import argparse

from pdserve.api.common import bytes_arg
from pdserve.engine.config import DTYPES, ROLES, EngineConfig


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="tiny", help="preset name (tiny, small) or a local HF checkpoint dir")
    g.add_argument("--device", default="cpu", help="cpu | cuda[:N] | npu[:N]")
    g.add_argument("--dtype", default="float32", choices=DTYPES)
    g.add_argument("--role", default="hybrid", choices=ROLES)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-bytes", type=bytes_arg, default=256 * 2**20,
                   help="KV cache budget in bytes, or a size as in the spec (20Gi, 512Mi)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (wins over bytes)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step (decodes and prefill chunks together)")
    g.add_argument("--prefill-chunk-tokens", type=int, default=512,
                   help="most prompt tokens one step prefills, all requests together")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    k = parser.add_argument_group("KV transfer")
    k.add_argument("--kv-transport", default="tcp", choices=("tcp", "shm", "mooncake", "none"))
    k.add_argument("--kv-host", default="127.0.0.1", help="address peers reach the KV transport on")
    k.add_argument("--kv-port", type=int, default=0)
    k.add_argument("--kv-auth-token", default=None, help="shared secret peers must present")
    k.add_argument("--decode-allocation", default="dispatch", choices=("dispatch", "prefill_complete"))
    k.add_argument("--kv-transfer-timeout", type=float, default=10.0, help="seconds per batch")
    k.add_argument("--kv-descriptor-timeout", type=float, default=10.0)
    k.add_argument("--kv-done-timeout", type=float, default=30.0)
    k.add_argument("--kv-lease", type=float, default=30.0)
    k.add_argument("--kv-abort-ack-timeout", type=float, default=5.0)
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
        kv_transport=args.kv_transport, kv_host=args.kv_host, kv_port=args.kv_port,
        kv_auth_token=args.kv_auth_token, decode_allocation=args.decode_allocation,
        kv_transfer_timeout_s=args.kv_transfer_timeout,
        kv_descriptor_timeout_s=args.kv_descriptor_timeout, kv_done_timeout_s=args.kv_done_timeout,
        kv_lease_s=args.kv_lease, kv_abort_ack_timeout_s=args.kv_abort_ack_timeout,
        fault_kv_send_delay_s=args.fault_kv_send_delay,
    )
