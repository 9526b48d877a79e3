"""The Coordinator's added latency and throughput, next to calling a stub engine directly.

Three processes: a stub engine (gRPC, answers each Generate with one token at
once), a Coordinator (``pdserve coordinator``) in front of it, and this load
generator. Measured in the same run:
  - latency, one request at a time: stub direct (gRPC) vs. through the Coordinator
    (HTTP POST /v1/completions, non-streaming); added = Coordinator - direct.
  - throughput: requests/s with ``--concurrency`` requests in flight for ``--seconds``.
Paths: ``--path pd`` (a stub P and a stub D, two legs per request) or ``hybrid``
(one stub engine, the single-engine path).

Rerun: .venv/bin/python benchmarks/coordinator_overhead.py [--path pd|hybrid]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.runtime.engine_client import EngineClient, build_generate_request  # noqa: E402
from tests.procs import PDSERVE, Proc  # noqa: E402
from tests.stub_engine import StubEngine, start_stub  # noqa: E402

BODY = {"model": "tiny", "prompt": "hello world", "max_tokens": 1, "temperature": 0}


def serve_stub(role: str) -> None:
    async def main():
        server, address = await start_stub(StubEngine(role=role))
        print(f"stub serving on {address}", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 10) - 1] if len(values) > 1 else values[0]


_ids = itertools.count()


async def direct_once(client: EngineClient) -> None:
    req = build_generate_request(f"direct-{next(_ids)}", prompt_token_ids=[104, 105], max_tokens=1)
    async for _ in client.generate(req, timeout_s=10):
        pass


async def http_once(session: aiohttp.ClientSession, url: str) -> None:
    async with session.post(url, json=BODY) as r:
        await r.read()
        assert r.status == 200, r.status


async def latency(fn, n: int) -> list[float]:
    for _ in range(min(200, n)):  # warm up
        await fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


async def throughput(fn, concurrency: int, seconds: float) -> float:
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker():
        nonlocal done
        while time.perf_counter() < stop_at:
            await fn()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - t0)


async def measure(args, stub_address: str, url: str) -> dict:
    out = {}
    async with EngineClient(stub_address) as client:
        out["direct"] = await latency(lambda: direct_once(client), args.requests)
        out["direct_rps"] = await throughput(lambda: direct_once(client), args.concurrency, args.seconds)
    conn = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:
        out["coordinator"] = await latency(lambda: http_once(session, url), args.requests)
        out["coordinator_rps"] = await throughput(lambda: http_once(session, url), args.concurrency,
                                                  args.seconds)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", choices=("pd", "hybrid"), default="pd")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--serve-stub", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_stub:
        serve_stub(args.serve_stub)
        return 0
    roles = ("prefill", "decode") if args.path == "pd" else ("hybrid",)
    stubs = [Proc([sys.executable, __file__, "--serve-stub", r]) for r in roles]
    procs = list(stubs)
    try:
        addrs = [s.wait_for(r"stub serving on (\S+)", 30).group(1) for s in stubs]
        engine_flags = [x for a in addrs for x in ("--engine", a)]
        coord = Proc([*PDSERVE, "coordinator", "--port", "0", "--log-level", "warning",
                      "--max-concurrency", "1024", *engine_flags])
        procs.append(coord)
        url = "http://" + coord.wait_for(r"serving on (\S+)", 60).group(1) + "/v1/completions"
        time.sleep(0.5)
        r = asyncio.run(measure(args, addrs[-1], url))
    finally:
        for p in procs:
            p.stop()
    d, c = r["direct"], r["coordinator"]
    print(f"path={args.path} requests={args.requests} concurrency={args.concurrency}")
    print(f"{'':14}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}")
    print(f"{'stub direct':14}{pct(d, 50) * 1e3:9.3f}{pct(d, 99) * 1e3:9.3f}{r['direct_rps']:9.0f}")
    print(f"{'coordinator':14}{pct(c, 50) * 1e3:9.3f}{pct(c, 99) * 1e3:9.3f}{r['coordinator_rps']:9.0f}")
    print(f"{'added':14}{(pct(c, 50) - pct(d, 50)) * 1e3:9.3f}{(pct(c, 99) - pct(d, 99)) * 1e3:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
