"""Partial KV transfer: bytes moved per request and TTFT with a shared system prompt.

Real engine processes over the TCP transport on loopback: one prefill engine (P) and
two decode engines, one with partial transfer (default) and one started with
``--no-kv-partial-transfer``. Every request is a 1,500-token system prompt shared by
all requests plus a 64-token question of its own; each round sends one request
through P to each D, in alternating order, so both see the same machine load.
Bytes moved are the D side's ``kv_transfer_bytes`` growth per request in pull mode
(P's in push and layer-wise); TTFT is the client's, at D.

    .venv/bin/python benchmarks/partial_transfer.py --rounds 20 --modes push pull
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from kv_exposed_transfer import kv_endpoint, one_request  # noqa: E402

from pdserve.runtime.engine_client import EngineClient  # noqa: E402
from tests.procs import PDSERVE, Proc  # noqa: E402

SYSTEM_TOKENS, QUESTION_TOKENS = 1500, 64


def start(role: str, *extra: str, model: str) -> tuple[Proc, str]:
    proc = Proc([*PDSERVE, "engine", "--model", model, "--role", role, "--port", "0",
                 "--kv-transport", "tcp", "--threads", "1", "--block-size", "16",
                 "--num-kv-blocks", "1024", "--max-num-batched-tokens", "2048",
                 "--log-level", "WARNING", *extra])
    return proc, proc.wait_for(r"serving model .* on (\S+:\d+)", timeout_s=180).group(1)


async def bytes_moved(client: EngineClient) -> int:
    return (await client.stats()).kv_transfer_bytes


async def measure(args, p: str, ds: dict[str, str]) -> dict:
    system = [(7 * i + 3) % 250 + 1 for i in range(SYSTEM_TOKENS)]
    p_kv = await kv_endpoint(p)
    d_kv = {name: await kv_endpoint(a) for name, a in ds.items()}
    results: dict = {}
    async with EngineClient(p) as pc:
        clients = {name: EngineClient(a) for name, a in ds.items()}
        for mode in args.modes:
            runs: dict[str, list] = {name: [] for name in ds}
            for r in range(args.rounds + 1):  # round 0 fills both caches
                order = list(ds) if r % 2 == 0 else list(reversed(ds))
                for name in order:
                    salt = 5 * r + 101 * args.modes.index(mode)  # a question of its own
                    question = [(11 * i + salt + 17) % 250 + 1 for i in range(QUESTION_TOKENS)]
                    counter = clients[name] if mode == "pull" else pc
                    before = await bytes_moved(counter)
                    got = await one_request(pc, clients[name], p_kv, d_kv[name], system + question,
                                            mode, f"{mode}-{name}-{r}")
                    got["bytes"] = await bytes_moved(counter) - before
                    if r:
                        runs[name].append(got)
            results[mode] = {name: {"bytes_per_request": statistics.median(x["bytes"] for x in rs),
                                    "ttft_ms_p50": 1e3 * statistics.median(x["ttft_s"] for x in rs)}
                             for name, rs in runs.items()}
            print(json.dumps({"mode": mode, **results[mode]}), flush=True)
        for c in clients.values():
            await c.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--modes", nargs="+", default=["push", "pull", "layerwise"])
    ap.add_argument("--model", default="tiny")
    args = ap.parse_args()
    procs = []
    try:
        p, p_addr = start("prefill", model=args.model)
        d1, d1_addr = start("decode", model=args.model)
        d2, d2_addr = start("decode", "--no-kv-partial-transfer", model=args.model)
        procs = [p, d1, d2]
        asyncio.run(measure(args, p_addr, {"partial": d1_addr, "full": d2_addr}))
    finally:
        for proc in procs:
            proc.stop()


if __name__ == "__main__":
    main()
