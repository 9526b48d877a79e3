"""``pdserve nodeagent``: flags, the engine command lines, and the process lifecycle.

One agent supervises one instance per Pod on Kubernetes, several in local mode
(``--instance ID=ROLE`` repeated). Engine settings come from the PDCluster spec
(``-f``, default: the built-in cluster), and so does the engine: pdserve's own, or
vLLM's OpenAI server (``spec.engine.backend``, ``launch.py``); ``--engine-arg``
appends raw engine flags.
The ROLE of ``--instance`` is the pool the instance belongs to (its settings apply)
and the role it starts in. ``--pin-cpus`` (local mode: ``pdserve up``) pins each
engine to its cores under the pool's ``cpuAffinity`` rule, which needs instance
ids named ``<cluster>-<pool>-<ordinal>``; without it ``cpuAffinity`` is ignored.
Simulated engines (``spec.engine.simulate``) of one pool share processes,
``perProcess`` engines each (``share_processes``).
Its HTTP endpoints listen on 127.0.0.1 unless ``--host`` says otherwise (the
operator passes 0.0.0.0 for the kubelet's probes); the engines inherit the
environment, cluster token included.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket

from pdserve.api import PDCluster
from pdserve.api.common import bytes_arg, positive_float_arg
from pdserve.api.instance import Pool, instance_ordinal
from pdserve.api.manifest import default_cluster
from pdserve.nodeagent.agent import Agent, AgentSettings, SupervisedEngine
from pdserve.nodeagent.engine_args import build_engine_argv
from pdserve.nodeagent.http import create_http_app
from pdserve.nodeagent.launch import EmbeddedLaunch, VllmLaunch
from pdserve.nodeagent.process import Backoff
from pdserve.runtime.cpu_priority import keep_off
from pdserve.runtime.http import run_component
from pdserve.runtime.logs import configure_logging
from pdserve.runtime.security import SecuritySettings

ROLES = ("prefill", "decode", "hybrid")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--controller", default="127.0.0.1:50050",
                   help="Controller HOST:PORT; comma-separated replicas are tried in turn")
    p.add_argument("--instance", action="append", required=True, metavar="ID=ROLE",
                   help="an instance to run (role: prefill, decode, hybrid); repeatable")
    p.add_argument("-f", "--cluster-file", help="PDCluster YAML for engine settings "
                   "(default: the built-in cluster)")
    p.add_argument("--kv-cache-bytes", type=bytes_arg, metavar="SIZE",
                   help="KV cache per engine, e.g. 20Gi or 512Mi; overrides spec.engine.kvCacheBytes "
                        "(spec.engine.numKvBlocks still wins when set)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                   help="extra engine flag, e.g. --engine-arg=--num-kv-blocks=64; repeatable; last, so it wins")
    p.add_argument("--engine-host", default="127.0.0.1",
                   help="address vLLM engines (spec.engine.backend vllm) listen on and are reached "
                        "at, their KV side channel too; the embedded engine takes --engine-arg=--host")
    p.add_argument("--agent-id", default=socket.gethostname(), help="name in heartbeats")
    p.add_argument("--heartbeat-interval", type=positive_float_arg, help="overrides spec.heartbeat.intervalSeconds")
    p.add_argument("--probe-timeout", type=positive_float_arg, default=1.0, help="seconds")
    p.add_argument("--restart-backoff", type=positive_float_arg, default=0.5, help="first restart delay, seconds")
    p.add_argument("--restart-backoff-max", type=positive_float_arg, default=30.0, help="seconds")
    p.add_argument("--restart-stable-after", type=positive_float_arg, default=30.0,
                   help="a run this long resets the backoff, seconds")
    p.add_argument("--probe-max-rate", type=positive_float_arg, default=AgentSettings.probe_max_rate,
                   help="engine probes (health and load) per second at most: with many engines "
                        "each is probed less often than every heartbeat interval")
    p.add_argument("--peer-probe-interval", type=positive_float_arg, default=AgentSettings.peer_probe_interval_s,
                   help="seconds between probes of a usable (prefill, decode peer) pair")
    p.add_argument("--peer-probe-retry", type=positive_float_arg, default=AgentSettings.peer_probe_retry_s,
                   help="seconds between probes of a pair whose last probe failed")
    p.add_argument("--peer-probe-max-rate", type=positive_float_arg, default=AgentSettings.peer_probe_max_rate,
                   help="re-probes of usable pairs per second at most (the interval stretches "
                        "past it with many pairs)")
    p.add_argument("--host", default="127.0.0.1",
                   help="HTTP listen address (0.0.0.0: every address, as the kubelet's probes need)")
    p.add_argument("--http-port", type=int, default=0,
                   help="/healthz, /readyz, /metrics, /status (0: a free port)")
    p.add_argument("--quiet-engines", action="store_true", help="do not echo engine output")
    p.add_argument("--pin-cpus", action="store_true",
                   help="pin engines to their pool's spec cpuAffinity cores (local mode)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


def parse_instance(text: str) -> tuple[str, str]:
    instance_id, _, role = text.partition("=")
    if not instance_id or role not in ROLES:
        raise SystemExit(f"--instance {text!r}: expected ID=ROLE with ROLE one of {', '.join(ROLES)}")
    return instance_id, role


def engine_cpus(cluster: PDCluster, instance_id: str, pool: str) -> tuple[int, ...]:
    """The cores ``instance_id`` is pinned to under its pool's ``cpuAffinity``; () if none."""
    pool_spec = getattr(cluster.spec, pool)
    if not pool_spec.cpu_affinity:
        return ()
    ordinal = instance_ordinal(cluster.metadata.name, pool, instance_id)
    if ordinal is None:
        raise SystemExit(f"--instance {instance_id}: spec.{pool}.cpuAffinity needs the id "
                         f"{cluster.metadata.name}-{pool}-<ordinal> to pick its cores")
    cpus = tuple(pool_spec.cpus_for_replica(ordinal) or ())
    if unusable := sorted(set(cpus) - os.sched_getaffinity(0)):
        raise SystemExit(f"spec.{pool}.cpuAffinity: core(s) {unusable} are not available "
                         f"to this process (usable: {sorted(os.sched_getaffinity(0))})")
    return cpus


def instance(cluster: PDCluster, instance_id: str, pool: Pool, args: argparse.Namespace) -> SupervisedEngine:
    """One instance of ``pool``, its engine launched as the spec's backend says."""
    cpus = engine_cpus(cluster, instance_id, pool) if args.pin_cpus else ()
    if cluster.spec.engine.backend == "vllm":
        if args.kv_cache_bytes is not None:
            engine = cluster.spec.engine.model_copy(update={"kv_cache_bytes": args.kv_cache_bytes})
            cluster = cluster.model_copy(update={"spec": cluster.spec.model_copy(update={"engine": engine})})
        launch = VllmLaunch(cluster, pool, args.engine_host, cpus, args.engine_arg)
        return SupervisedEngine(instance_id, pool, pool, [], cpus=cpus, launch=launch)
    extra = [f"--kv-cache-bytes={args.kv_cache_bytes}"] if args.kv_cache_bytes is not None else []
    return SupervisedEngine(instance_id, pool, pool, build_engine_argv(cluster, pool, extra + args.engine_arg),
                            cpus=cpus)


def share_processes(instances: list[SupervisedEngine], per_process: int) -> None:
    """Give the instances of each pool, in order, one launch (so one process) per
    ``per_process`` of them; an instance of another pool starts a new process."""
    shared: EmbeddedLaunch | None = None
    num_in_shared = 0
    for i, inst in enumerate(instances):
        if shared is None or num_in_shared == per_process or inst.pool != instances[i - 1].pool:
            shared, num_in_shared = EmbeddedLaunch(inst.argv), 0
        inst.launch = shared
        num_in_shared += 1


def agent_settings(args: argparse.Namespace, cluster: PDCluster) -> AgentSettings:
    """The agent's settings from its flags (the heartbeat interval from the spec unless
    a flag overrides it)."""
    return AgentSettings(
        agent_id=args.agent_id, controllers=tuple(args.controller.split(",")),
        interval_s=args.heartbeat_interval or cluster.spec.heartbeat.interval_seconds,
        probe_timeout_s=args.probe_timeout, probe_max_rate=args.probe_max_rate,
        echo_engine_output=not args.quiet_engines,
        peer_probe_interval_s=args.peer_probe_interval, peer_probe_retry_s=args.peer_probe_retry,
        peer_probe_max_rate=args.peer_probe_max_rate,
        backoff=Backoff(args.restart_backoff, args.restart_backoff_max, args.restart_stable_after))


async def serve(args: argparse.Namespace) -> int:
    cluster = PDCluster.from_file(args.cluster_file) if args.cluster_file else default_cluster()
    settings = agent_settings(args, cluster)
    instances = [instance(cluster, iid, pool, args) for iid, pool in map(parse_instance, args.instance)]
    if cluster.spec.engine.simulate is not None:
        share_processes(instances, cluster.spec.engine.simulate.per_process)
    if args.pin_cpus:  # each engine's cores checked above: the agent itself runs beside them
        keep_off({cpu for inst in instances for cpu in inst.cpus or ()}, f"nodeagent {args.agent_id}")
    agent = Agent(settings, instances, SecuritySettings.from_env())
    return await run_component(
        agent, create_http_app(agent), args.host, args.http_port,
        lambda http_port: f"nodeagent {args.agent_id} supervising {len(instances)} engine(s) "
                          f"(http port {http_port}, controller {args.controller})")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    return asyncio.run(serve(args))
