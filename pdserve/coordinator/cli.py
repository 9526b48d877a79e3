"""``pdserve coordinator``: serve the OpenAI-compatible REST endpoint.

Instance view from ``--controller HOST:PORT`` (the Controller's WatchView stream)
or from ``--engine HOST:PORT`` given once per engine (polled for Health and Stats).
Prints ``pdserve coordinator serving on HOST:PORT`` once listening (``--port 0``
picks a free port).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys

from pydantic import ValidationError

from pdserve.api.cluster import FallbackPolicy, RoutingPolicy, TransferMode
from pdserve.api.common import bytes_arg
from pdserve.runtime import gc_tuning
from pdserve.runtime.logs import configure_logging

from .settings import CoordinatorSettings

_POLICIES = RoutingPolicy.__args__
_MODES = TransferMode.__args__
_FALLBACKS = FallbackPolicy.__args__
ADMIN_KEY_FILE_ENV = "PDSERVE_ADMIN_KEY_FILE"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = CoordinatorSettings()
    parser.add_argument("--host", default="127.0.0.1", help="REST listen address")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--model", default=d.model, help="preset (tiny, small) or checkpoint dir, for the tokenizer")
    parser.add_argument("--dtype", default=d.dtype, help="the engines' dtype, shown in /v1/models "
                        "(auto: the checkpoint's)")
    parser.add_argument("--served-model-name", default=None,
                        help="name clients send as model (default: --model)")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--engine", action="append", default=[], metavar="HOST:PORT",
                     help="static engine address (repeat); roles are read from each engine; "
                          "a vLLM server as vllm://HOST:PORT?role=prefill|decode|hybrid"
                          "[&kv=SIDE_CHANNEL_HOST:PORT&connector=NixlConnector] (docs/vllm.md)")
    src.add_argument("--controller", default=None, metavar="HOST:PORT[,HOST:PORT]",
                     help="the Controller's gRPC address; several replicas comma-separated")
    parser.add_argument("--coordinator-id", default=socket.gethostname(),
                        help="name in the Controller's view watch")
    parser.add_argument("--prefill-policy", default=d.prefill_policy, choices=_POLICIES,
                        help="how a prefill engine is picked")
    parser.add_argument("--decode-policy", default=d.decode_policy, choices=_POLICIES,
                        help="how a decode engine is picked")
    parser.add_argument("--kv-mode", default=d.kv_mode, choices=_MODES, help="KV transfer mode")
    parser.add_argument("--local-prefill-max-tokens", type=int, default=d.local_prefill_max_tokens,
                        help="conditional disaggregation threshold in uncached tokens (0: off)")
    parser.add_argument("--fallback-policy", default=d.fallback_policy, choices=_FALLBACKS,
                        help="what to do when a pool has no ready engine")
    parser.add_argument("--block-size", type=int, default=d.block_size,
                        help="engines' KV block size in tokens, for prefix hashing")
    parser.add_argument("--ttft-slo-s", type=float, default=None, help="TTFT target, seconds")
    parser.add_argument("--tpot-slo-s", type=float, default=None,
                        help="TPOT target: bounds how long a prefill on D may stall its streams")
    parser.add_argument("--no-load-aware-local-prefill", dest="load_aware_local_prefill",
                        action="store_false",
                        help="prefill on D only by --local-prefill-max-tokens, never by P's load")
    parser.add_argument("--first-token-timeout-s", type=float, default=d.first_token_timeout_s,
                        help="how long a request may wait for its first token: queue, routing, "
                             "prefill, KV transfer and retries included")
    parser.add_argument("--token-idle-timeout-s", type=float, default=d.token_idle_timeout_s,
                        help="the longest gap between two tokens of a stream (and before a "
                             "continuation's next token)")
    parser.add_argument("--request-timeout-s", type=float, default=None,
                        help="a total per request, the whole generation included (default: "
                             "none; a client may set its own, the smaller applies)")
    parser.add_argument("--max-concurrency", type=int, default=d.max_concurrency,
                        help="requests served at once")
    parser.add_argument("--max-queue", type=int, default=d.max_queue,
                        help="requests waiting for a slot; beyond: 429")
    parser.add_argument("--max-body-bytes", type=bytes_arg, default=d.max_body_bytes, metavar="SIZE",
                        help="largest request body, e.g. 1Mi; beyond: 413")
    parser.add_argument("--max-retries", type=int, default=d.max_retries,
                        help="retries of a failed leg")
    parser.add_argument("--poll-interval-s", type=float, default=d.poll_interval_s,
                        help="static engines: seconds between Health and Stats reads")
    parser.add_argument("--max-tokens-default", type=int, default=d.max_tokens_default,
                        help="max_tokens of a request that gives none")
    parser.add_argument("--api-key-file", default=None, help="file holding the API key (bearer token)")
    parser.add_argument("--admin-key-file", default=os.environ.get(ADMIN_KEY_FILE_ENV),
                        help="file holding the admin key: also an API key, and the only one "
                             f"shown engine addresses in timings (env {ADMIN_KEY_FILE_ENV})")
    parser.add_argument("--overload-max-wait-s", type=float, default=d.overload_max_wait_s,
                        help="how long a request waits for an engine with room after a \"full\"; then 503")
    parser.add_argument("--move-stalled-s", type=float, default=d.move_stalled_s,
                        help="a stream stalled this long on a decode engine that queues "
                             "requests goes on on one with room; 0: never")
    parser.add_argument("--http-keep-alive-s", type=float, default=d.http_keep_alive_s,
                        help="idle keep-alive connections close after this")
    parser.add_argument("--http-header-timeout-s", type=float, default=d.http_header_timeout_s,
                        help="a connection that sends no complete request headers within this closes")
    parser.add_argument("--http-body-timeout-s", type=float, default=d.http_body_timeout_s,
                        help="a request body not received within this after its headers: 408")
    parser.add_argument("--max-connections", type=int, default=d.max_connections,
                        help="open HTTP connections (or requests) beyond which requests get 503")
    parser.add_argument("--cluster-name", default=None,
                        help="the PDCluster this Coordinator serves, shown on the status page")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


def settings_from_args(args: argparse.Namespace) -> CoordinatorSettings:
    return CoordinatorSettings(
        model=args.model, served_model_name=args.served_model_name, dtype=args.dtype, engines=tuple(args.engine),
        controller=args.controller, coordinator_id=args.coordinator_id,
        prefill_policy=args.prefill_policy, decode_policy=args.decode_policy, kv_mode=args.kv_mode,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        fallback_policy=args.fallback_policy, block_size=args.block_size,
        ttft_slo_s=args.ttft_slo_s, tpot_slo_s=args.tpot_slo_s,
        load_aware_local_prefill=args.load_aware_local_prefill,
        first_token_timeout_s=args.first_token_timeout_s,
        token_idle_timeout_s=args.token_idle_timeout_s, request_timeout_s=args.request_timeout_s,
        max_concurrency=args.max_concurrency, max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes, max_retries=args.max_retries,
        poll_interval_s=args.poll_interval_s, max_tokens_default=args.max_tokens_default,
        api_key_file=args.api_key_file, cluster_name=args.cluster_name,
        admin_key_file=args.admin_key_file, overload_max_wait_s=args.overload_max_wait_s,
        move_stalled_s=args.move_stalled_s,
        http_keep_alive_s=args.http_keep_alive_s, http_header_timeout_s=args.http_header_timeout_s,
        http_body_timeout_s=args.http_body_timeout_s, max_connections=args.max_connections,
    )


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    import uvicorn

    from .app import create_app
    from .http_server import build_config

    try:
        settings = settings_from_args(args)
        app = create_app(settings)
    except (ValidationError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP;
    # without it every response waits ~40 ms for a delayed ACK (Nagle).
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
        sock.listen(2048)  # connections queue until uvicorn accepts them
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(build_config(app, settings, args.log_level.lower()))
    gc_tuning.tune()  # start-up is done: what it built is frozen out of collections
    print(f"pdserve coordinator serving on {host}:{port}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])  # on the config's loop: uvloop
    return 0
