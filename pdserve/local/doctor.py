"""``pdserve doctor``: check a cluster before traffic and print one table of findings.

Targets: ``-f cluster.yaml`` (the spec; its ``pdserve up`` run, found through the run
dir's ``addresses.json`` and ``cluster-token``, when one is running), ``--controller
ADDR`` (the engines the Controller's view lists) or ``--url`` (a Coordinator: its
``/ready?verbose=1`` pair table). Checks, each one line pass / warn / fail with the
reason and a fix:

- host (``doctor_checks``): model source, tokenizer + chat template, KV transport
  (mooncake importable, RDMA devices), TLS files, etcd (``--etcd``);
- cluster: each pool has its replicas ready (here); the rest is
  ``pdserve.runtime.doctor_checks.check_engines``, which the operator runs too for the
  PDCluster's ``Doctor`` condition: every engine answers Health and Stats with the
  model; its KV budget holds one request of the model's max length; P and D
  compatibility hashes match; every P reaches every D's KV endpoint with a real test
  transfer (the engines' ProbePeer RPC); clock skew to each engine;
- the Coordinator's readiness and pairs, when its URL is known, and what its engine
  sessions ride (a warning for one on gRPC: no session port, or not reachable).

Exit status 1 when any check fails, else 0. Reads ``pdserve.api`` and
``pdserve.runtime`` only; talks to the components over the network.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc

from pdserve.api import PDCluster, default_cluster
from pdserve.api.proto import controller_pb2 as cpb
from pdserve.api.proto import controller_pb2_grpc as cpb_grpc
from pdserve.local.doctor_checks import (
    check_etcd,
    check_extras,
    check_model,
    check_tls,
    check_tokenizer,
    check_transport,
)
from pdserve.local.runstate import RunState, default_run_dir
from pdserve.local.up import TOKEN_FILE
from pdserve.runtime.doctor_checks import FAIL, PASS, RPC_TIMEOUT_S, WARN, Check, check_engines
from pdserve.runtime.security import SecuritySettings, create_channel


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--file", help="PDCluster YAML: checks the spec and its `pdserve up` run "
                                        "(default: the built-in cluster, what `pdserve up` runs)")
    p.add_argument("--url", help="Coordinator URL: checks its readiness and P/D pairs")
    p.add_argument("--controller", metavar="ADDR", help="Controller gRPC address: checks its engines")
    p.add_argument("--run-dir", type=Path, help="the `pdserve up` run dir (default: per cluster)")
    p.add_argument("--etcd", metavar="HOST:PORT", help="also check that this etcd is reachable and writable")
    p.add_argument("--require-rdma", action="store_true",
                   help="fail (not warn) when Mooncake is asked and this host has no RDMA device")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")


def run(args: argparse.Namespace) -> int:
    checks = diagnose(args)
    print(json.dumps([c.__dict__ for c in checks], indent=1) if args.json else render(checks))
    return 1 if any(c.status == FAIL for c in checks) else 0


def diagnose(args: argparse.Namespace) -> list[Check]:
    cluster = PDCluster.from_file(args.file) if args.file else None
    if cluster is None and not (args.url or args.controller):
        cluster = default_cluster()  # what `pdserve up` runs without -f
    security = SecuritySettings.from_env()
    controller, url = args.controller, args.url
    checks: list[Check] = []
    if cluster is not None:
        checks += check_extras(cluster) + check_model(cluster) + check_tokenizer(cluster)
        checks += check_transport(cluster, args.require_rdma)
        state = RunState(args.run_dir or default_run_dir(cluster.metadata.name))
        found = state.read_addresses()
        controller = controller or found.get("controller")
        url = url or found.get("coordinator")
        token_file = state.run_dir / TOKEN_FILE
        if not security.token and token_file.is_file():
            security = replace(security, token=token_file.read_text().strip())
        if controller is None:
            checks.append(Check("cluster", FAIL, f"no running `pdserve up` for {cluster.metadata.name!r} "
                                f"(nothing in {state.run_dir})",
                                f"pdserve up -f {args.file}" if args.file else "pdserve up"))
    checks += check_tls(security) + check_etcd(args.etcd)
    if controller:
        checks += asyncio.run(check_cluster(controller, security, cluster))
    if url:
        checks += check_coordinator(url)
    return checks


async def check_cluster(controller: str, security: SecuritySettings,
                        cluster: PDCluster | None) -> list[Check]:
    """Every engine of the Controller's view, and every P → D pair."""
    try:
        async with create_channel(controller, security) as channel:
            view = await cpb_grpc.ControllerStub(channel).GetView(
                cpb.WatchViewRequest(coordinator_id="pdserve-doctor"), timeout=RPC_TIMEOUT_S,
                metadata=security.metadata())
    except grpc.aio.AioRpcError as exc:
        return [Check("controller", FAIL, f"{controller}: {exc.code().name}: {exc.details()}",
                      "start the cluster, or check the address and PDSERVE_CLUSTER_TOKEN(_FILE)")]
    checks = [Check("controller", PASS, f"{controller}: view mode {view.mode}, "
                                        f"{len(view.instances)} ready instances")]
    if cluster is not None:
        checks += check_pools(cluster, view)
    return checks + await check_engines(view.instances, security)


def check_pools(cluster: PDCluster, view) -> list[Check]:
    rows = []
    for pool in ("prefill", "decode", "hybrid"):
        want = getattr(cluster.spec, pool).replicas
        have = sum(i.role == pool for i in view.instances)
        if want or have:
            ok = have >= want
            rows.append(Check(f"{pool} pool", PASS if ok else FAIL, f"{have} of {want} instances ready",
                              "" if ok else "see the NodeAgent's and engines' logs for why one is missing"))
    return rows


def check_coordinator(url: str) -> list[Check]:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/ready?verbose=1", timeout=RPC_TIMEOUT_S) as r:
            body = json.load(r)
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read() or b"{}")
    except (OSError, ValueError) as exc:
        return [Check("coordinator", FAIL, f"{url}: {exc}", "start the Coordinator or fix --url")]
    ready = body.get("status") == "ready"
    detail = body.get("detail", {})
    rows = [Check("coordinator", PASS if ready else FAIL, f"{url}: {body.get('status')} "
                  f"(PD: {detail.get('pd', '?')}, mode {detail.get('mode', '?')})",
                  "" if ready else "see the pair rows below and the Coordinator's log")]
    for pair in body.get("pairs", []):
        rows.append(Check(f"route {pair['prefill']} -> {pair['decode']}",
                          PASS if pair["usable"] else FAIL, pair["reason"] or "usable"))
    return rows + check_sessions(body.get("sessions", {}))


def check_sessions(sessions: dict[str, str]) -> list[Check]:
    """The Coordinator's open engine sessions (its ``/ready?verbose=1``; none open
    before the first request). One that cannot open fails its requests, which the
    Coordinator's log and the route rows say."""
    if not sessions:
        return []
    return [Check("engine sessions", PASS, f"{len(sessions)} open, on the engines' session ports")]


def render(checks: list[Check]) -> str:
    width = max((len(c.name) for c in checks), default=10)
    lines = [f"{'STATUS':6}  {'CHECK':{width}}  DETAIL"]
    for c in checks:
        lines.append(f"{c.status.upper():6}  {c.name:{width}}  {c.detail}")
        if c.fix and c.status != PASS:
            lines.append(f"{'':6}  {'':{width}}  fix: {c.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL)}
    lines.append(f"{counts[PASS]} pass, {counts[WARN]} warn, {counts[FAIL]} fail")
    return "\n".join(lines)
