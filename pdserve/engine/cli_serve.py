"""``pdserve engine``: serve one engine over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from pdserve.engine.cli_args import add_engine_arguments, engine_config_from_args
from pdserve.engine.config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from pdserve.api.security import SecuritySettings
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.server import serve

    try:
        security = SecuritySettings.from_env()
        config = engine_config_from_args(args)
        # The cluster token also guards the KV transport: no one else writes into our KV.
        config.kv_auth_token = config.kv_auth_token or security.token
        engine = LLMEngine(config)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def ready(port: int) -> None:
        address = f"{args.host}:{port}"
        print(f"pdserve engine serving model {engine.model_config.name!r} on {address}", flush=True)
        print(
            f"  try: pdserve generate --server {address} --prompt 'Hello' --max-tokens 16",
            flush=True,
        )

    try:
        asyncio.run(serve(engine, args.host, args.port, ready, security))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
