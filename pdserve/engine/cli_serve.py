"""``pdserve engine``: serve one engine over gRPC until SIGTERM or SIGINT.

Either signal shuts the engine down in order (server.py): in-flight requests get
``--shutdown-grace-s`` to finish, then the KV transport closes and the KV shm segment
(``/dev/shm/pdserve-kv-<pid>-<hex>``, see transport/shm.py) is unlinked; the exit code
is 0 and nothing is printed but log lines. A signal while the model loads ends the
start-up the same quiet way.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from pdserve.engine.cli_args import add_engine_arguments, engine_config_from_args
from pdserve.engine.config import ConfigError
from pdserve.engine.kv_transfer.transport.base import TransportUnavailable
from pdserve.runtime import gc_tuning
from pdserve.runtime.logs import configure_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to serve gRPC (and metrics) on")
    parser.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    parser.add_argument("--session-port", type=_port, default=0,
                        help="serve the Coordinator's sessions as frames on this port "
                             "(0: a free one); the engine's Health names it")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus /metrics over HTTP on this port (0: a free one)")
    parser.add_argument("--shutdown-grace-s", type=float, default=10.0,
                        help="on SIGTERM/SIGINT, seconds in-flight requests get to finish")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    # Until the server installs its own handlers, SIGTERM interrupts like Ctrl-C.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("pdserve engine: interrupted while starting", file=sys.stderr, flush=True)
        return 0


def _run(args: argparse.Namespace) -> int:
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.server import serve
    from pdserve.runtime.security import SecuritySettings

    try:
        security = SecuritySettings.from_env()
        config = engine_config_from_args(args)
        # The cluster token also guards the KV transport: no one else writes into our KV.
        config.kv_auth_token = config.kv_auth_token or security.token
        engine = LLMEngine(config)
    except (ConfigError, ValueError, OSError, TransportUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    gc_tuning.tune()  # the model is loaded: it and the modules are frozen out of collections

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
                          args.metrics_port, metrics_ready, args.shutdown_grace_s,
                          args.session_port))
    except OSError as exc:  # serve closed the engine
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("pdserve engine stopped", flush=True)
    return 0


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 (a free one) to 65535, not {value}")
    return port
