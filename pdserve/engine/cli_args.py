"""Command-line flags shared by ``pdserve engine`` and ``pdserve generate``."""

from __future__ import annotations

import argparse

from pdserve.engine.config import DTYPES, ROLES, EngineConfig


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="tiny", help="preset name (tiny, small) or a local HF checkpoint dir")
    g.add_argument("--device", default="cpu", help="cpu | cuda[:N] | npu[:N]")
    g.add_argument("--dtype", default="float32", choices=DTYPES)
    g.add_argument("--role", default="hybrid", choices=ROLES)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-bytes", type=int, default=256 * 2**20, help="KV cache budget in bytes")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (wins over bytes)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, role=args.role,
        block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching, num_threads=args.threads,
    )
