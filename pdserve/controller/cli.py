"""``pdserve controller``: flags, settings from the PDCluster spec, and the process lifecycle.

The spec (``--cluster-file`` or the built-in default) gives the cluster name,
heartbeat thresholds and fallback policy; flags override them (tests use short
intervals). SIGTERM/SIGINT stop it cleanly: the leader resigns, so a standby
takes over at once.

Where it listens: ``--host``, else the host of ``--advertise`` (the address peers
are told), else 127.0.0.1; ``--host 0.0.0.0`` listens on every address. etcd
(``--store etcd://A,B,...``: every member's endpoint) is reached with TLS and a
user when ``--etcd-*`` flags or their ``PDSERVE_ETCD_*`` variables say so.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from pdserve.api import PDCluster
from pdserve.api.common import positive_float_arg
from pdserve.api.manifest import default_cluster
from pdserve.controller.cluster import ClusterSettings
from pdserve.controller.core import Controller, ControllerSettings
from pdserve.controller.etcd_store import EtcdAccess
from pdserve.controller.fallback import POOL_ROLES, FallbackSettings
from pdserve.controller.health import HealthThresholds
from pdserve.controller.planner import PlannerSettings
from pdserve.controller.rebalance import RebalanceSettings
from pdserve.controller.service import create_grpc_server, create_http_app
from pdserve.controller.store import open_store
from pdserve.runtime.cpu_priority import set_nice
from pdserve.runtime.http import run_component
from pdserve.runtime.logs import configure_logging
from pdserve.runtime.security import SecuritySettings

WILDCARDS = ("0.0.0.0", "::", "")


STARTUP_GRACE_S = 60.0
VLLM_STARTUP_GRACE_S = 300.0


def startup_grace_s(flag: float | None, spec) -> float:
    """How long a cluster that never was complete stays out of fallback: the flag, else
    long enough for its engines to start (vLLM's compile takes minutes)."""
    if flag is not None:
        return flag
    return VLLM_STARTUP_GRACE_S if spec.engine.backend == "vllm" else STARTUP_GRACE_S


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--cluster-file", help="PDCluster YAML (default: the built-in cluster)")
    p.add_argument("--store", default="memory://",
                   help="memory:// or etcd://HOST:PORT[,HOST:PORT...] (every etcd member, tried in turn)")
    etcd = p.add_argument_group("etcd access (each flag defaults to its PDSERVE_ETCD_* variable)")
    for flag, what in [("ca", "CA file etcd's certificate must chain to (turns TLS on)"),
                       ("cert", "client certificate file (for etcd --client-cert-auth)"),
                       ("key", "the client certificate's key file"),
                       ("user", "etcd user"),
                       ("password-file", "file holding the etcd user's password")]:
        env = "PDSERVE_ETCD_" + flag.upper().replace("-", "_")
        etcd.add_argument(f"--etcd-{flag}", default=os.environ.get(env), help=f"{what} [{env}]")
    p.add_argument("--host", help="gRPC and HTTP listen address (default: the host of --advertise, "
                                  "else 127.0.0.1; 0.0.0.0: every address)")
    p.add_argument("--port", type=int, default=50050, help="gRPC port; 0 picks a free one")
    p.add_argument("--http-port", type=int, default=0,
                   help="/metrics, /healthz, /readyz, /leaderz (0: a free port)")
    p.add_argument("--advertise", help="HOST:PORT peers reach this replica on (the leader key value)")
    p.add_argument("--leader-ttl", type=int, default=5, help="seconds; a dead leader is replaced after this, and a leader "
                        "cut off from the store stops leading after 0.9 of it")
    p.add_argument("--lease-ttl", type=int, default=30, help="seconds an instance record outlives its agent")
    p.add_argument("--heartbeat-interval", type=positive_float_arg, help="overrides spec.heartbeat.intervalSeconds")
    p.add_argument("--max-heartbeats-per-second", type=positive_float_arg,
                   default=ClusterSettings.max_heartbeats_per_s,
                   help="heartbeats a second the leader asks of its agents at most: with more agents "
                        "than this per interval each is told a longer interval (and judged by it)")
    p.add_argument("--suspect-after", type=int, help="missed heartbeats before SUSPECT")
    p.add_argument("--failed-after", type=int, help="missed heartbeats before FAILED")
    p.add_argument("--hysteresis", type=float, help="overrides spec.fallback.hysteresisSeconds")
    p.add_argument("--startup-grace", type=float,
                   help="seconds before an incomplete cluster may enter fallback (default: 60, "
                        f"{VLLM_STARTUP_GRACE_S:g} with spec.engine.backend vllm, which loads and "
                        "compiles for minutes)")
    p.add_argument("--replace-after-failures", type=int, default=3,
                   help="failures within --replace-window before the operator replaces an instance's Pod")
    p.add_argument("--replace-window", type=float, default=600.0, help="seconds")
    p.add_argument("--rebalance-window", type=float, default=30.0, help="seconds of imbalance before a role switch")
    p.add_argument("--rebalance-min-interval", type=float, default=120.0, help="seconds between role switches")
    p.add_argument("--no-rebalance", action="store_true", help="never switch roles")
    p.add_argument("--planner", choices=("spec", "off", "advisory", "on"), default="spec",
                   help="the SLO planner: as spec.planner says, or off, advisory (decide and report "
                        "only) or on, overriding it")
    p.add_argument("--nice", type=int, help="run at this CPU priority (a nice value; below 0 needs root "
                                           "or CAP_SYS_NICE): ahead of the engines on a shared host")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


def build_settings(args: argparse.Namespace, cluster: PDCluster, identity: str) -> ControllerSettings:
    spec = cluster.spec
    hb = spec.heartbeat
    thresholds = HealthThresholds(
        interval_s=args.heartbeat_interval or hb.interval_seconds,
        suspect_after_missed=args.suspect_after or hb.suspect_after_missed,
        failed_after_missed=args.failed_after or hb.failed_after_missed)
    configured = tuple(r for r in POOL_ROLES if getattr(spec, r).replicas > 0)
    fb = FallbackSettings(
        policy=spec.fallback.policy, startup_grace_s=startup_grace_s(args.startup_grace, spec),
        configured_roles=configured,
        hysteresis_s=spec.fallback.hysteresis_seconds if args.hysteresis is None else args.hysteresis)
    rebalance = RebalanceSettings(window_s=args.rebalance_window,
                                  min_interval_s=args.rebalance_min_interval,
                                  reverse_cooldown_s=5 * args.rebalance_min_interval,
                                  enabled=not args.no_rebalance and spec.planner.overload_switching)
    return ControllerSettings(
        cluster_name=cluster.metadata.name, identity=identity, leader_ttl_s=args.leader_ttl,
        lease_ttl_s=args.lease_ttl,
        cluster=ClusterSettings(thresholds=thresholds, fallback=fb, rebalance=rebalance,
                                planner=planner_settings(spec, args.planner),
                                replicas=tuple((r, getattr(spec, r).replicas) for r in POOL_ROLES),
                                replace_after_failures=args.replace_after_failures,
                                replace_window_s=args.replace_window,
                                max_heartbeats_per_s=args.max_heartbeats_per_second,
                                forget_after_s=max(args.lease_ttl, thresholds.interval_s * 20)))


def planner_settings(spec, override: str = "spec") -> PlannerSettings | None:
    """``spec.planner`` with ``spec.slo`` (2000 ms TTFT, 100 ms TPOT when unset), turned
    on, off or advisory by ``override`` (``--planner``); None when off."""
    p = spec.planner
    enabled = p.enabled if override == "spec" else override != "off"
    if not enabled:
        return None
    advisory = {"spec": p.advisory, "on": False, "advisory": True}[override]
    return PlannerSettings(
        ttft_ms=spec.slo.ttft_ms or 2000.0, tpot_ms=spec.slo.tpot_ms or 100.0,
        interval_s=p.interval_seconds, window_s=p.window_seconds, cooldown_s=p.cooldown_seconds,
        stable_ticks=p.stable_intervals, min_requests=p.min_requests, min_prefill=p.min_prefill,
        max_prefill=p.max_prefill, min_decode=p.min_decode, max_decode=p.max_decode,
        max_engines=p.max_engines, advisory=advisory,
        scale_down_delay_s=p.window_seconds if p.scale_down_delay_seconds is None else p.scale_down_delay_seconds)


def listen_host(args: argparse.Namespace) -> str:
    """The address to listen on: ``--host``, else the one announced by ``--advertise``."""
    if args.host is not None:
        return args.host
    if args.advertise:
        return args.advertise.rpartition(":")[0].strip("[]") or "127.0.0.1"
    return "127.0.0.1"


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def etcd_access(args: argparse.Namespace) -> EtcdAccess:
    return EtcdAccess.from_files(args.etcd_ca, args.etcd_cert, args.etcd_key, args.etcd_user,
                                 args.etcd_password_file)


async def serve(args: argparse.Namespace) -> int:
    cluster = PDCluster.from_file(args.cluster_file) if args.cluster_file else default_cluster()
    store = open_store(args.store, etcd_access(args))
    security = SecuritySettings.from_env()
    controller = Controller(build_settings(args, cluster, "pending"), store)
    bind = listen_host(args)
    server, port = await create_grpc_server(controller, host_port(bind, args.port), security)
    host = "127.0.0.1" if bind in WILDCARDS else bind
    identity = args.advertise or host_port(host, port)
    controller.settings = build_settings(args, cluster, identity)
    controller.election.identity = identity
    return await run_component(
        controller, create_http_app(controller), bind, args.http_port,
        lambda http_port: f"controller serving on {host_port(host, port)} (http {host_port(host, http_port)}, "
                          f"store {args.store}, {'leader' if controller.is_leader else 'standby'})",
        after_stop=lambda: server.stop(1.0))


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    set_nice(args.nice, "controller")  # before any thread: each inherits it
    return asyncio.run(serve(args))
