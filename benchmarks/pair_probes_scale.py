"""KV path probes per interval against the number of engines: each Coordinator probing
every pair (before) against the prefill engines' agents probing once for the cluster,
the Controller publishing the result (after). In one process, with the real classes
and probes that pass at once (``ask`` stubs, counted):

  before   ``--coordinators`` Coordinators, each a ``PairChecks`` over a view of N
           engines without published checks (a static list, or a Controller before
           this change): one round each, as every ``pair_probe_interval_s`` (30 s)
  after    a Controller ``Cluster`` fed one heartbeat per engine; one agent
           ``PeerChecks`` per prefill engine, sent the Controller's peer list, runs
           one round (every ``peer_probe_interval_s``, 30 s) and reports; a second
           heartbeat carries the reports; each Coordinator's ``PairChecks`` over the
           published view (``ControllerWatcher.apply``) runs one round
  CPU      one round's process time: a Coordinator's before (stub asks: the bookkeeping
           alone, no network), the slowest agent's after
  sizes    the ClusterView's bytes (the Controller's view, pushed to every
           Coordinator), the peer list's (sent to an agent when its version moved)

Engines: ``--prefill-share`` of N prefill, the rest decode, one compat hash.

Rerun: .venv/bin/python benchmarks/pair_probes_scale.py [--engines 100,1000] [--coordinators 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from pdserve.api.proto import controller_pb2 as cpb
from pdserve.api.proto import engine_pb2 as pb
from pdserve.controller.cluster import Cluster, ClusterSettings
from pdserve.coordinator.instances import InstanceRegistry
from pdserve.coordinator.pairs import PairChecks
from pdserve.coordinator.watcher import ControllerWatcher
from pdserve.nodeagent.peers import PeerChecks


class PassingProber:
    def __init__(self) -> None:
        self.num_probes = 0

    async def probe_peer(self, endpoint: str, timeout_s: float) -> pb.ProbePeerResponse:
        self.num_probes += 1
        return pb.ProbePeerResponse(ok=True)


class AgentEngine:
    """A prefill engine as its agent's peer checks see it."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id, self.role, self.address = instance_id, "prefill", f"{instance_id}:1"
        self.health = pb.HealthResponse(kv_compat_hash="h")


def reports(num_engines: int, num_prefill: int) -> list[cpb.InstanceReport]:
    out = []
    for k in range(num_engines):
        role = "prefill" if k < num_prefill else "decode"
        iid = f"{role}-{k}"
        out.append(cpb.InstanceReport(
            instance_id=iid, role=role, pool=role, process_state="running", probe_ok=True,
            engine_address=f"{iid}:1", kv_endpoint=f"{iid}:2", kv_transport="tcp", kv_compat_hash="h"))
    return out


def coordinator_round(view: cpb.ClusterView) -> tuple[int, float]:
    """One Coordinator: apply the view, run one pair-check round; (probes, seconds)."""
    registry = InstanceRegistry()
    ControllerWatcher(registry, "127.0.0.1:1", "bench").apply(view)
    checks = PairChecks(registry)

    async def ask(p, d):
        return True, "", 0.0

    checks._ask = ask
    started = time.process_time()
    asyncio.run(checks.check_once())
    return checks.num_probes, time.process_time() - started


def measure(num_engines: int, share: float, num_coordinators: int) -> dict:
    num_prefill = max(1, round(num_engines * share))
    num_decode = num_engines - num_prefill
    cluster = Cluster(ClusterSettings(), now_s=0.0)
    cluster.apply_heartbeat("agents", reports(num_engines, num_prefill), 0.0)
    plain = cluster.view("controller")
    plain.publishes_pairs = False
    plain.ClearField("unusable_pairs")

    before = [coordinator_round(plain) for _ in range(num_coordinators)]

    peers = cluster.peer_list()
    engines = [AgentEngine(f"prefill-{k}") for k in range(num_prefill)]
    agent_probes, agent_s = 0, 0.0
    checked = []
    for engine in engines:  # one agent per prefill engine (its own checks, prober, list)
        prober = PassingProber()
        checks = PeerChecks(lambda inst, prober=prober: prober, lambda: None)
        checks.update(peers)
        started = time.process_time()
        asyncio.run(checks.check_once([engine]))
        agent_s = max(agent_s, time.process_time() - started)
        agent_probes += prober.num_probes
        report = cpb.InstanceReport(instance_id=engine.instance_id, role="prefill",
                                    engine_address=engine.address)
        checks.fill(report)
        checked.append(report.peers_checked_version)
    beat = reports(num_engines, num_prefill)
    for rep in beat[:num_prefill]:
        rep.peers_checked_version, rep.checks_peers = peers.version, True
    cluster.apply_heartbeat("agents", beat, 1.0)
    published = cluster.view("controller")
    after = [coordinator_round(published) for _ in range(num_coordinators)]
    usable = PairChecks(InstanceRegistry())  # is every pair usable from the published view?
    registry = usable.registry
    ControllerWatcher(registry, "127.0.0.1:1", "bench").apply(published)
    prefill = [i for i in registry.all() if i.role == "prefill"]
    decode = [i for i in registry.all() if i.role == "decode"]
    num_usable = sum(usable.usable(p, d) for p in prefill for d in decode)
    return {
        "engines": num_engines, "prefill": num_prefill, "decode": num_decode,
        "before": sum(n for n, _ in before), "before_round_s": max(s for _, s in before),
        "agents": agent_probes, "agent_round_s": agent_s, "per_agent": agent_probes // num_prefill,
        "after_coordinators": sum(n for n, _ in after), "after_round_s": max(s for _, s in after),
        "all_checked": all(v == peers.version for v in checked), "usable": num_usable,
        "pairs": num_prefill * num_decode,
        "view_bytes_before": plain.ByteSize(), "view_bytes_after": published.ByteSize(),
        "peer_list_bytes": peers.ByteSize(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="100,1000")
    parser.add_argument("--coordinators", type=int, default=3)
    parser.add_argument("--prefill-share", type=float, default=0.25)
    args = parser.parse_args()
    print(f"{args.coordinators} Coordinators, {args.prefill_share:.0%} prefill; probes per 30 s interval")
    print("| engines | P x D | before: Coordinators' probes | after: agents' probes (each) "
          "| after: Coordinators' probes | pairs usable from the view | view bytes before / after "
          "| peer list bytes | CPU of one round: a Coordinator before / an agent after |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.engines.split(",")):
        r = measure(n, args.prefill_share, args.coordinators)
        assert r["all_checked"] and r["usable"] == r["pairs"], r
        print(f"| {r['engines']} | {r['prefill']} x {r['decode']} | {r['before']:,} | "
              f"{r['agents']:,} ({r['per_agent']}) | {r['after_coordinators']} | {r['usable']:,} | "
              f"{r['view_bytes_before']:,} / {r['view_bytes_after']:,} | {r['peer_list_bytes']:,} | "
              f"{r['before_round_s']:.2f} s / {r['agent_round_s'] * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
