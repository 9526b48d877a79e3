"""The Coordinator's routing decision against the number of engines, in one process.

Issue 35 asks that the Coordinator's CPU per request stay flat (within 1.2x) from 10
to 1,000 engines. ``sim_scale.py`` runs whole clusters, where the routing decision is
lost among the HTTP server, the legs and the two cores' contention; this benchmark
builds only the routing state, with the real classes, and times the decision alone:

  view      a Controller ``ClusterView`` of N instances (``--prefill-share`` of them
            prefill, the rest decode, one compat hash, every load figure drawn at
            random per engine), applied as the watcher applies it
            (``ControllerWatcher.apply``: ``views_from_view``, ``apply_view``)
  pairs     ``PairChecks`` with stub engines whose ``probe_peer`` passes at once:
            one round probes every P x D pair, as a Coordinator's first round does;
            ``--published``: the view carries the Controller's pair checks instead
            (every pair checked), and the Coordinator probes none
  router    ``Router`` with the default settings (prefill ``prefix_cache_aware``,
            decode ``least_loaded``, layerwise: decode first) and a ``PrefixIndex`` of
            ``--index-blocks`` per engine (its bound, the Coordinator's, N times
            that), every engine's filled first with blocks of
            its own (so each new prompt evicts as many, at every N, as in a steady
            state); ``--prefix``: then ``--prefix-chains`` shared chains of 64 blocks
            (of 4 x that many) recorded on each engine, and half the prompts open
            with one
  prompts   each decision a new one, 512 to 2,047 tokens (hashed outside the timing)
  decision  ``registry.max_model_len()`` (serving checks the context length against
            it) and ``await router.plan(...)``, timed together (``perf_counter_ns``);
            then, as legs do, the planned engines' ``num_inflight`` rises, and the
            oldest of ``--concurrency`` requests in flight ends (it falls); every
            ``--view-every`` decisions a new view with new load figures is applied
            (not timed with the decisions, but a decision after it pays for what the
            view made stale). The first decision is timed apart: it works out which
            engines pair (every P x D), as the first after a change of members does;
            so is one after the decisions, once a decode engine is marked full (the
            pools change, the members do not: ``InstanceRegistry.mark_full``).
  view      per view: ``ControllerWatcher.apply`` and one pair-check round (it runs
            on every view change), timed together
  memory    ``tracemalloc``: what the registry, pair results, router and index hold
            once built and after ``--view-every`` decisions (a build of its own:
            tracing slows it)

Prints a table per variant, each N against the first.

Rerun: .venv/bin/python benchmarks/routing_scale.py [--engines 10,100,300,1000] [--prefix] [--published]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import random
import statistics
import time
import tracemalloc

from pdserve.api.proto import controller_pb2 as cpb
from pdserve.api.proto import engine_pb2 as pb
from pdserve.coordinator.instances import InstanceRegistry
from pdserve.coordinator.metrics import CoordinatorMetrics
from pdserve.coordinator.pairs import PairChecks
from pdserve.coordinator.policies import RouteContext
from pdserve.coordinator.prefix_index import PrefixIndex
from pdserve.coordinator.router import Router
from pdserve.coordinator.settings import CoordinatorSettings
from pdserve.coordinator.watcher import ControllerWatcher
from pdserve.runtime.block_hash import hash_chain
from pdserve.runtime.security import SecuritySettings

BLOCK_SIZE = 16
CHAIN_BLOCKS = 64  # blocks of one shared prefix (1,024 tokens)


class ProbeOnly:
    """An engine that only answers pair probes (no request is sent)."""

    transport = ""

    async def probe_peer(self, endpoint: str, test_transfer: bool = False,
                         timeout_s: float = 5.0) -> pb.ProbePeerResponse:
        return pb.ProbePeerResponse(ok=True)

    async def close(self) -> None:
        pass


def build_view(num_engines: int, prefill_share: float, rng: random.Random,
               published: bool = False) -> cpb.ClusterView:
    num_prefill = max(1, round(num_engines * prefill_share))
    view = cpb.ClusterView(mode="PD", publishes_pairs=published)
    for k in range(num_engines):
        role = "prefill" if k < num_prefill else "decode"
        used = rng.randrange(0, 4000)
        view.instances.add(
            instance_id=f"{role[0]}{k:04d}", role=role, health="READY",
            engine_address=f"10.0.{k // 250}.{k % 250}:50051",
            kv_endpoint=f"10.0.{k // 250}.{k % 250}:50052", kv_compat_hash="h",
            max_model_len=8192, peers_checked_version=int(published and role == "prefill"),
            peers_listed_version=int(published and role == "decode"),
            load=cpb.InstanceLoad(num_running=rng.randrange(0, 48), num_waiting=rng.choice((0, 0, 0, 1, 3)),
                                  num_kv_blocks_used=used, num_kv_blocks_free=4096 - used))
    return view


def prompt(rng: random.Random, chains: list[list[int]], prefix: bool) -> RouteContext:
    """A new prompt of 512 to 2,047 tokens (``--prefix``: half of them open with a shared
    chain), its hashes computed here, not in the decision's time."""
    tokens = list(rng.randbytes(rng.randrange(512, 2048)))
    if prefix and chains and rng.random() < 0.5:
        tokens = rng.choice(chains) + tokens
    return RouteContext(tokens, BLOCK_SIZE, hash_chain(tokens, BLOCK_SIZE))


async def build(num_engines: int, args, rng: random.Random):
    """The Coordinator's routing state for ``num_engines`` engines, every pair probed."""
    settings = CoordinatorSettings(controller="controller:1",
                                   prefix_index_max_blocks=args.index_blocks * num_engines)
    registry = InstanceRegistry(SecuritySettings(), settings.suspect_s, connect=lambda _: ProbeOnly())
    watcher = ControllerWatcher(registry, "controller:1", "bench", SecuritySettings())
    watcher.apply(build_view(num_engines, args.prefill_share, rng, args.published))
    pairs = PairChecks(registry, settings.pair_probe_interval_s, settings.pair_probe_retry_s,
                       settings.pair_probe_timeout_s, settings.pair_probe_concurrency)
    await pairs.check_once()
    index = PrefixIndex(settings.prefix_index_max_blocks)
    for inst in registry.all():  # full, as after a while of traffic: each new prompt evicts
        for _ in range(args.index_blocks // CHAIN_BLOCKS):
            index.record(inst.instance_id, [rng.randbytes(16) for _ in range(CHAIN_BLOCKS)])
    chains: list[list[int]] = []
    if args.prefix:
        chains = [[rng.randrange(32000) for _ in range(CHAIN_BLOCKS * BLOCK_SIZE)]
                  for _ in range(args.prefix_chains * 4)]
        hashes = [hash_chain(c, BLOCK_SIZE) for c in chains]
        for inst in registry.all():
            for h in rng.sample(hashes, args.prefix_chains):
                index.record(inst.instance_id, h)
    router = Router(settings, registry, index, CoordinatorMetrics(), pairs)
    return settings, registry, watcher, pairs, router, chains


async def decide_many(num_engines: int, args, rng: random.Random) -> dict:
    settings, registry, watcher, pairs, router, chains = await build(num_engines, args, rng)
    views = [build_view(num_engines, args.prefill_share, rng, args.published) for _ in range(4)]
    inflight: collections.deque = collections.deque()
    decisions_ns: list[int] = []
    views_ns: list[int] = []
    t0 = time.perf_counter_ns()
    await router.plan(prompt(rng, chains, args.prefix), set(), time.monotonic() + 10)
    first_ns = time.perf_counter_ns() - t0  # the pairing of every P x D, worked out once
    gc.collect()
    gc.disable()  # a collection would land on whichever decision runs into it
    try:
        for k in range(args.decisions):
            if k and k % args.view_every == 0:
                t0 = time.perf_counter_ns()
                watcher.apply(views[(k // args.view_every) % len(views)])
                await pairs.check_once()
                views_ns.append(time.perf_counter_ns() - t0)
            ctx = prompt(rng, chains, args.prefix)
            t0 = time.perf_counter_ns()
            registry.max_model_len()  # serving reads it per request, before routing
            plan = await router.plan(ctx, set(), time.monotonic() + 10)
            decisions_ns.append(time.perf_counter_ns() - t0)
            engines = plan.engines()
            for e in engines:
                e.num_inflight += 1
            inflight.append(engines)
            if len(inflight) > args.concurrency:
                for e in inflight.popleft():
                    e.num_inflight -= 1
    finally:
        gc.enable()
    registry.mark_full(registry.pools().decode[0].instance_id, 60)  # it answered "full"
    t0 = time.perf_counter_ns()
    await router.plan(prompt(rng, chains, args.prefix), set(), time.monotonic() + 10)
    mark_ns = time.perf_counter_ns() - t0  # the pairing of the pools without it
    decisions_ns.sort()
    return {"median_us": statistics.median(decisions_ns) / 1e3,
            "p99_us": decisions_ns[int(len(decisions_ns) * 0.99)] / 1e3,
            "mean_us": statistics.fmean(decisions_ns) / 1e3, "max_us": decisions_ns[-1] / 1e3,
            "view_ms": statistics.median(views_ns) / 1e6 if views_ns else 0.0,
            "first_ms": first_ns / 1e6, "mark_ms": mark_ns / 1e6}


async def memory(num_engines: int, args, rng: random.Random) -> float:
    """MiB the routing state holds after a build and ``--view-every`` decisions."""
    gc.collect()
    tracemalloc.start()
    state = await build(num_engines, args, rng)
    for _ in range(3):
        await asyncio.sleep(0)  # the pair-check round's tasks end and are freed
    router = state[4]
    for _ in range(args.view_every):
        await router.plan(prompt(rng, state[5], args.prefix), set(), time.monotonic() + 10)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del state
    return held / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="10,100,300,1000")
    ap.add_argument("--prefill-share", type=float, default=0.25, help="of the engines prefill (1:3)")
    ap.add_argument("--decisions", type=int, default=5000)
    ap.add_argument("--view-every", type=int, default=500,
                    help="decisions between two views (a view a second at 500 requests/s)")
    ap.add_argument("--concurrency", type=int, default=256, help="requests in flight")
    ap.add_argument("--prefix", action="store_true", help="fill the prefix index first")
    ap.add_argument("--prefix-chains", type=int, default=8, help="chains of 64 blocks per engine")
    ap.add_argument("--index-blocks", type=int, default=1024,
                    help="the prefix index's blocks per engine, filled first (its bound, one for "
                         "all engines, is this times the engines; a Coordinator's default: 65,536)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--published", action="store_true",
                    help="views carry the Controller's pair checks (every pair checked), as a "
                         "Controller whose agents check peers sends them: the Coordinator probes none")
    args = ap.parse_args()
    sizes = [int(n) for n in args.engines.split(",")]
    rows = []
    for n in sizes:
        row = asyncio.run(decide_many(n, args, random.Random(n)))
        row["mib"] = 0.0 if args.no_memory else asyncio.run(memory(n, args, random.Random(n)))
        rows.append((n, row))
        print(f"  {n} engines done", flush=True)
    base = rows[0][1]
    variant = ("prefix index filled" if args.prefix else "empty prefix index") + (
        ", published pair checks" if args.published else "")
    print(f"\nrouting decision, {variant}, {args.decisions} decisions, a view every {args.view_every}")
    print(f"| engines | median µs | p99 µs | mean µs | max µs | median / p99 / mean vs {sizes[0]} | "
          "first decision ms | after a mark ms | view ms | MiB |")
    print("|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for n, r in rows:
        print(f"| {n} | {r['median_us']:.1f} | {r['p99_us']:.1f} | {r['mean_us']:.1f} | {r['max_us']:.0f} | "
              f"{r['median_us'] / base['median_us']:.2f} / {r['p99_us'] / base['p99_us']:.2f} / "
              f"{r['mean_us'] / base['mean_us']:.2f} | {r['first_ms']:.2f} | {r['mark_ms']:.2f} | {r['view_ms']:.2f} | "
              f"{r['mib']:.1f} |")

if __name__ == "__main__":
    main()
