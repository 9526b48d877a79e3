"""Exposed KV-transfer time on the TTFT critical path: pull vs push vs layer-wise.

For each link (loopback, and a rate-limited veth pair between two network
namespaces), each mode and each prompt length, one request at a time goes through a
real prefill engine (P) and decode engine (D) over the TCP transport:

    exposed = TTFT seen by the client at D  -  P's queue time  -  P's prefill compute

The same run measures every mode, so push (all KV written after prefill) is the
baseline that layer-wise must hide: hidden = 1 - exposed(layerwise) / exposed(push).
"P-side exposed" is P's own measure of the same thing (first token -> every write
settled and DONE sent), without the gRPC and client hops that the TTFT includes.

``--tp 2:1,1:1,2:2`` measures prefill and decode engines at those tensor-parallel
sizes (P:D) in the same run, layouts alternated over ``--rounds``: the exposed time of
P TP=2 -> D TP=1 (each D head gathered from P's ranks, strided per token) against the
equal-TP layouts (whole blocks). ``--transport`` picks the KV transport (tcp, mooncake).

The rate-limited link needs root (``ip netns``, ``tc``); the benchmark creates the
namespaces and removes them afterwards, also on failure.

    sudo .venv/bin/python benchmarks/kv_exposed_transfer.py            # both links
    .venv/bin/python benchmarks/kv_exposed_transfer.py --links loopback
    .venv/bin/python benchmarks/kv_exposed_transfer.py --links loopback --model small \
        --lengths 1024,4096 --modes push,layerwise --tp 1:1,2:1,2:2 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdserve.runtime.engine_client import EngineClient, build_generate_request  # noqa: E402
from tests.procs import PDSERVE, Proc  # noqa: E402

NS_P, NS_D = "pdbench-p", "pdbench-d"
ADDR_P, ADDR_D = "10.77.0.1", "10.77.0.2"


def sh(*args: str, check: bool = True) -> None:
    subprocess.run(args, check=check, capture_output=True)


def setup_netns(rate: str) -> None:
    teardown_netns()
    sh("ip", "netns", "add", NS_P)
    sh("ip", "netns", "add", NS_D)
    sh("ip", "link", "add", "veth-pdp", "type", "veth", "peer", "name", "veth-pdd")
    sh("ip", "link", "set", "veth-pdp", "netns", NS_P)
    sh("ip", "link", "set", "veth-pdd", "netns", NS_D)
    for ns, dev, addr in ((NS_P, "veth-pdp", ADDR_P), (NS_D, "veth-pdd", ADDR_D)):
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
           "rate", rate, "burst", "256kb", "latency", "100ms")


def teardown_netns() -> None:
    for ns in (NS_P, NS_D):
        sh("ip", "netns", "del", ns, check=False)


def start(role: str, host: str, ns: str | None, args, tp: int) -> tuple[Proc, str]:
    cmd = [*PDSERVE, "engine", "--model", args.model, "--role", role, "--host", host,
           "--kv-host", host, "--port", "0", "--kv-transport", args.transport, "--threads", "1",
           "--tensor-parallel-size", str(tp),
           "--block-size", "16", "--kv-cache-bytes", str(args.kv_cache_mib * 2**20),
           "--max-num-batched-tokens", str(max(args.lengths)), "--no-prefix-caching",
           "--kv-transfer-timeout", "60", "--kv-descriptor-timeout", "60",
           "--kv-done-timeout", "120", "--log-level", "WARNING"]
    if ns:
        cmd = ["ip", "netns", "exec", ns, *cmd]
    proc = Proc(cmd)
    m = proc.wait_for(r"serving model .* on (\S+:\d+)", timeout_s=180)
    return proc, m.group(1)


async def one_request(pc, dc, p_kv, d_kv, prompt, mode, rid) -> dict:
    """One disaggregated request over already-connected clients (no handshake in TTFT)."""
    kv = {"mode": mode, "transfer_id": rid}
    t0 = time.perf_counter()
    d_call = dc.generate(build_generate_request(
        rid, "", prompt, max_tokens=2, ignore_eos=True,
        kv_transfer={**kv, "role": "decode", "peer": p_kv}), timeout_s=300)
    p_call = pc.generate(build_generate_request(
        rid, "", prompt, max_tokens=2, ignore_eos=True,
        kv_transfer={**kv, "role": "prefill", "peer": d_kv}), timeout_s=300)

    async def first_d():
        async for m in d_call:
            if m.token_ids:
                ttft = time.perf_counter() - t0
                async for _ in d_call:
                    pass
                return ttft
        raise RuntimeError("decode leg ended without a token")

    d_task = asyncio.ensure_future(first_d())
    p_timings, p_final = None, None
    async for m in p_call:
        if m.token_ids:
            p_timings = m.timings
        if m.finished:
            p_final = m
    ttft = await d_task
    if p_final.finish_reason != "handoff":
        raise RuntimeError(f"prefill leg failed: {p_final.error}")
    return {"ttft_s": ttft, "queue_s": p_timings.queue_s, "prefill_s": p_timings.prefill_s,
            "p_transfer_s": p_final.timings.kv_transfer_s}


async def client_main(args) -> None:
    """Runs where it can reach both engines; prints one JSON line per measurement."""
    info = json.loads(args.client)
    async with EngineClient(info["p"]) as pc, EngineClient(info["d"]) as dc:
        await pc.health()
        await dc.health()
        for length in args.lengths:
            prompt = [(7 * i + 3) % 250 + 1 for i in range(length)]
            for mode in args.modes:
                await one_request(pc, dc, info["p_kv"], info["d_kv"], prompt, mode,
                                  f"warm-{mode}-{length}")
                runs = [await one_request(pc, dc, info["p_kv"], info["d_kv"], prompt, mode,
                                          f"{mode}-{length}-{r}") for r in range(args.repeats)]
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                print(json.dumps({"length": length, "mode": mode, **med}), flush=True)


async def kv_endpoint(address: str) -> str:
    async with EngineClient(address) as c:
        return (await c.health()).kv_endpoint


def run_link(link: str, args, tp: tuple[int, int] = (1, 1)) -> list[dict]:
    shaped = link != "loopback"
    procs = []
    try:
        if shaped:
            setup_netns(link)
        p, p_addr = start("prefill", ADDR_P if shaped else "127.0.0.1", NS_P if shaped else None,
                          args, tp[0])
        procs.append(p)
        d, d_addr = start("decode", ADDR_D if shaped else "127.0.0.1", NS_D if shaped else None,
                          args, tp[1])
        procs.append(d)
        info = {"p": p_addr, "d": d_addr}
        client = [sys.executable, __file__, "--client", "{}", "--model", args.model,
                  "--lengths", ",".join(map(str, args.lengths)), "--modes", ",".join(args.modes),
                  "--repeats", str(args.repeats)]
        if shaped:
            client = ["ip", "netns", "exec", NS_P, *client]
        # Ask for the KV endpoints from where the engines are reachable.
        probe = subprocess.run(
            [*client[: client.index(__file__)], "-c",
             "import asyncio,sys,json;sys.path.insert(0,'.');"
             "from benchmarks.kv_exposed_transfer import kv_endpoint as k;"
             f"print(json.dumps([asyncio.run(k('{p_addr}')),asyncio.run(k('{d_addr}'))]))"],
            cwd=REPO, capture_output=True, text=True, check=True)
        info["p_kv"], info["d_kv"] = json.loads(probe.stdout)
        client[client.index("{}")] = json.dumps(info)
        out = subprocess.run(client, cwd=REPO, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"client failed:\n{out.stderr[-3000:]}\nP:\n{p.output[-2000:]}\nD:\n{d.output[-2000:]}")
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        for r in rows:
            r["link"] = "loopback" if not shaped else link
            r["tp"] = f"{tp[0]}:{tp[1]}"
        return rows
    finally:
        for proc in procs:
            proc.stop()
        if shaped:
            teardown_netns()


def merge_rounds(rows: list[dict]) -> list[dict]:
    """One row per (tp, link, length, mode): the median of each measure over rounds."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["tp"], r["link"], r["length"], r["mode"]), []).append(r)
    return [{**runs[0], **{k: statistics.median(r[k] for r in runs)
                           for k in ("ttft_s", "queue_s", "prefill_s", "p_transfer_s")}}
            for runs in groups.values()]


def report(rows: list[dict], kv_bytes_per_token: int) -> None:
    print("| P:D TP | link | prompt | mode | KV MiB | TTFT ms | prefill ms | exposed ms "
          "| hidden vs push | P-side exposed ms | P-side hidden |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    by_key = {(r["tp"], r["link"], r["length"], r["mode"]): r for r in rows}
    for r in rows:
        exposed = r["ttft_s"] - r["queue_s"] - r["prefill_s"]
        push = by_key.get((r["tp"], r["link"], r["length"], "push"))
        hidden = p_hidden = ""
        if push and r["mode"] == "layerwise":
            push_exposed = push["ttft_s"] - push["queue_s"] - push["prefill_s"]
            hidden = f"{100 * (1 - exposed / push_exposed):.0f}%" if push_exposed > 0 else ""
            if push["p_transfer_s"] > 0:
                p_hidden = f"{100 * (1 - r['p_transfer_s'] / push['p_transfer_s']):.0f}%"
        print(f"| {r['tp']} | {r['link']} | {r['length']} | {r['mode']} | "
              f"{r['length'] * kv_bytes_per_token / 2**20:.1f} | {1e3 * r['ttft_s']:.1f} | "
              f"{1e3 * r['prefill_s']:.1f} | {1e3 * exposed:.1f} | {hidden} | "
              f"{1e3 * r['p_transfer_s']:.1f} | {p_hidden} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--modes", default="pull,push,layerwise", type=lambda s: s.split(","))
    parser.add_argument("--links", default="loopback,1gbit", type=lambda s: s.split(","))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-mib", type=int, default=256)
    parser.add_argument("--transport", default="tcp", choices=("tcp", "mooncake"))
    parser.add_argument("--tp", default="1:1", help="P:D tensor-parallel sizes, comma-separated",
                        type=lambda s: [tuple(int(x) for x in pair.split(":")) for pair in s.split(",")])
    parser.add_argument("--rounds", type=int, default=1, help="runs of every --tp layout, alternated")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        asyncio.run(client_main(args))
        return 0
    if any(link != "loopback" for link in args.links) and os.geteuid() != 0:
        print("the rate-limited link needs root (ip netns, tc)", file=sys.stderr)
        return 2
    from pdserve.engine.loader import preset_config

    cfg = preset_config(args.model)
    kv_per_token = cfg.kv_bytes_per_token(4)
    rows = []
    for link in args.links:
        for _ in range(args.rounds):
            for tp in args.tp:
                rows += run_link(link, args, tp)
    print(f"model {args.model}: {cfg.num_hidden_layers} layers, KV {kv_per_token} bytes/token "
          f"(fp32), transport {args.transport}, {args.rounds} round(s) (medians)")
    report(merge_rounds(rows), kv_per_token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
