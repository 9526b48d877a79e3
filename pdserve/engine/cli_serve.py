"""``pdserve engine``: serve one engine over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pdserve.api.logs import configure_logging
from pdserve.engine.cli_args import add_engine_arguments, engine_config_from_args
from pdserve.engine.config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus /metrics over HTTP on this port (0: a free one)")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
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

    def metrics_ready(port: int) -> None:
        print(f"pdserve engine metrics on http://{args.host}:{port}/metrics", flush=True)

    try:
        asyncio.run(serve(engine, args.host, args.port, ready, security,
                          args.metrics_port, metrics_ready))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
