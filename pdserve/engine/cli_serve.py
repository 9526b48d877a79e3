"""``pdserve engine``: serve one engine over gRPC until SIGTERM or SIGINT.

With ``--simulate --roles prefill,decode,...`` one process serves one simulated engine
per role listed, each a whole engine of its own (ports, server, loop, KV transport), so
a machine holds many more of them (docs/simulate.md); it prints each engine's "serving"
line in the order of ``--roles``, which is how its supervisor tells them apart.

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
from dataclasses import replace

from pdserve.engine.cli_args import add_engine_arguments, engine_config_from_args
from pdserve.engine.config import ROLES, ConfigError, EngineConfig
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
    parser.add_argument("--roles", type=_roles, default=None, metavar="ROLE,ROLE,...",
                        help="with --simulate: serve one engine per role listed in this process "
                             "(instead of --role); engine i takes every port flag plus i, or free "
                             "ports where the flag is 0")
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

    engines: list[LLMEngine] = []
    try:
        security = SecuritySettings.from_env()
        for config in engine_configs(args):
            # The cluster token also guards the KV transport: no one else writes into our KV.
            config.kv_auth_token = config.kv_auth_token or security.token
            engines.append(LLMEngine(config))
    except (ConfigError, ValueError, OSError, TransportUnavailable) as exc:
        for engine in engines:
            engine.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    gc_tuning.tune()  # the model is loaded: it and the modules are frozen out of collections
    model = engines[0].model_config.name
    several = len(engines) > 1

    def ready(i: int, port: int) -> None:
        address = f"{args.host}:{port}"
        which = f" {i} ({engines[i].config.role})" if several else ""
        print(f"pdserve engine{which} serving model {model!r} on {address}", flush=True)
        if not several:
            print(f"  try: pdserve generate --server {address} --prompt 'Hello' --max-tokens 16",
                  flush=True)

    def metrics_ready(i: int, port: int) -> None:
        which = f" {i}" if several else ""
        print(f"pdserve engine{which} metrics on http://{args.host}:{port}/metrics", flush=True)

    try:
        asyncio.run(serve(engines, args.host, args.port, ready, security,
                          args.metrics_port, metrics_ready, args.shutdown_grace_s,
                          args.session_port))
    except OSError as exc:  # serve closed the engines
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("pdserve engine stopped", flush=True)
    return 0


def engine_configs(args: argparse.Namespace) -> list[EngineConfig]:
    """One engine's config per engine this process serves: the flags', or with ``--roles``
    one per role, engine i on ``--kv-port`` plus i (free ports when it is 0)."""
    config = engine_config_from_args(args)
    if args.roles is None:
        return [config]
    if config.simulate is None:
        raise ConfigError("--roles serves several engines in one process, which only simulated "
                          "engines do (--simulate)")
    return [replace(config, role=role, kv_port=config.kv_port and config.kv_port + i)
            for i, role in enumerate(args.roles)]


def _roles(value: str) -> list[str]:
    roles = value.split(",")
    if not all(role in ROLES for role in roles):
        raise argparse.ArgumentTypeError(f"roles are {', '.join(ROLES)}, comma separated; not {value!r}")
    return roles


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 (a free one) to 65535, not {value}")
    return port
