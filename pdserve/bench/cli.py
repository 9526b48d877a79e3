"""``pdserve bench``: goodput of an OpenAI-compatible server, or of two specs side by side.

Owns the command: its flags, the order of a session (resolve the flags, measure every
point, report, write ``--json``/``--plot``) and the exit codes: 0 done, 1 nothing
could be measured (server unreachable, every request failed, a deployment did not
come up), 2 bad input (flags, workload or dataset), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import httpx
import yaml

from pdserve.runtime import extras
from pdserve.runtime.ports import free_port

from .client import CompletionClient
from .compare import (
    Deployment,
    DeploymentError,
    derive_slo,
    key_metrics,
    median_metrics,
    ratio_rows,
    round_order,
)
from .loadgen import RunSettings, build_streams, run_point
from .options import Point, build_points, describe_slos, resolve_slos, resolve_workload
from .report import build_run_report, format_compare, format_run
from .stats import RequestResult, SLOSet
from .workload import WorkloadError, workload_as_dict

POINT_SEED_STRIDE = 1009  # seed offset between the points of a sweep (prime, != warm-up's)

Measured = list[tuple[Point, list[RequestResult]]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", metavar="URL",
                   help="server URL, with or without /v1 (default %(default)s)")
    g.add_argument("--model", metavar="NAME", help="model name (default: the first one /v1/models lists)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), metavar="KEY", help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=300.0, metavar="S", help="per request (default 300)")
    g.add_argument("--wait-ready", type=float, default=0.0, metavar="S",
                   help="first retry a 1-token completion for up to S seconds")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", metavar="NAME|FILE",
                   help="built-in 'mixed' (default: 8 closed-loop chat streams 32->128 tokens + a "
                        "1800->8 prompt every 3 s) or a YAML/JSON workload file")
    g.add_argument("--dataset", metavar="JSONL", help="ShareGPT-style or {prompt, max_tokens} rows")
    g.add_argument("--prompt-tokens", metavar="DIST", help="N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA")
    g.add_argument("--output-tokens", metavar="DIST", help="same forms; always generated in full")
    g.add_argument("--prompt-kind", choices=("ids", "text"), default="ids",
                   help="synthetic prompts as token ids or random words (default ids)")
    g.add_argument("--vocab-size", type=int, default=256, metavar="N",
                   help="id prompts are drawn from [0, N) (default 256: safe for the tiny preset)")
    g.add_argument("--seed", type=int, metavar="N", help="default: the workload's (0)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="default 0 (greedy)")
    g = p.add_argument_group("arrivals and bounds (replace the workload's)")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--rate", type=float, metavar="R", help="open loop, requests/s")
    one.add_argument("--concurrency", type=int, metavar="N", help="closed loop, requests in flight")
    one.add_argument("--rates", metavar="R1,R2,..", help="a sweep: one run per rate")
    g.add_argument("--arrival", choices=("poisson", "periodic"), default="poisson", help="for --rate/--rates (default poisson)")
    g.add_argument("--num-requests", type=int, metavar="N", help="stop sending after N requests")
    g.add_argument("--duration", type=float, metavar="S", help="stop sending after S seconds (no bound at all: 60)")
    g.add_argument("--warmup", type=int, default=1, metavar="N", help="unrecorded requests first (default 1)")
    g = p.add_argument_group("SLO (goodput counts requests meeting all given; [CLASS=] for one class)")
    for flag in ("--slo-ttft-ms", "--slo-tpot-ms", "--slo-max-itl-ms"):
        g.add_argument(flag, action="append", metavar="[CLASS=]MS")
    g = p.add_argument_group("output")
    g.add_argument("--json", type=Path, metavar="PATH", help="write the whole report")
    g.add_argument("--plot", type=Path, metavar="DIR", help="write PNGs (ITL/TTFT CDFs, goodput vs rate)")
    g.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    g.add_argument("--show-workload", action="store_true", help="print the resolved workload and exit")
    g = p.add_argument_group("compare two deployments (pdserve up -f SPEC, one at a time)")
    g.add_argument("--compare", nargs=2, type=Path, metavar=("A.yaml", "B.yaml"),
                   help="ratios are A/B: A the PD spec, B the colocated baseline")
    g.add_argument("--rounds", type=int, default=2, metavar="N", help="A,B,A,B,...; medians across rounds (default 2)")
    g.add_argument("--slo-from", type=float, metavar="RATE",
                   help="without --slo-*: derive the SLO from the baseline at this sweep rate "
                        "(default: the first point, the lightest load)")
    g.add_argument("--run-dir", type=Path, metavar="DIR", help="deployments' logs (default: a temporary directory)")
    g.add_argument("--port", type=int, metavar="PORT", help="first Coordinator port (default: free ports)")
    g.add_argument("--up-timeout", type=float, default=900.0, metavar="S",
                   help="for a deployment to come up and serve (default 900)")


def run(args: argparse.Namespace) -> int:
    try:
        workload = resolve_workload(args)
        slos, points = resolve_slos(args, workload), build_points(args, workload)
        settings = RunSettings(args.prompt_kind, args.vocab_size, workload.num_requests,
                               workload.duration_s, args.warmup, not args.no_progress)
        _check_args(args)
        slo_reference(points, args.slo_from)  # a bad --slo-from fails before any load
        build_streams(workload, points[0].arrival, settings)  # reads datasets: fail before any load
    except WorkloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.show_workload:
        print(yaml.safe_dump(workload_as_dict(workload), sort_keys=False), end="")
        return 0
    config = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                       if k != "api_key"},
              "workload": workload_as_dict(workload)}
    try:
        if args.compare:
            return _compare(args, workload, slos, points, settings, config)
        return _single(args, workload, slos, points, settings, config)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (DeploymentError, TimeoutError, OSError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _check_args(args: argparse.Namespace) -> None:
    for name in ("vocab_size", "rounds"):
        if getattr(args, name) < 1:
            raise WorkloadError(f"--{name.replace('_', '-')}: must be >= 1")
    if args.warmup < 0 or (args.num_requests is not None and args.num_requests < 1):
        raise WorkloadError("--warmup must be >= 0 and --num-requests >= 1")
    if args.duration is not None and args.duration <= 0:
        raise WorkloadError("--duration: must be > 0")
    for spec in args.compare or ():
        if not spec.is_file():
            raise WorkloadError(f"--compare: {spec} is not a file")
    if args.plot and extras.missing_modules("plots"):  # say so before any load, not after
        raise WorkloadError(extras.explain("--plot", "plots"))


async def _measure(base_url: str, args, workload, points: list[Point], settings, wait_s: float) -> Measured:
    async with CompletionClient(base_url, args.model, args.api_key, args.request_timeout,
                                args.temperature) as client:
        if wait_s > 0:
            await client.wait_until_serving(wait_s)
        await client.discover_model()
        return [(pt, await run_point(client, wl, pt.arrival, settings, pt.label))
                for pt, wl in zip(points, point_workloads(workload, len(points)), strict=True)]


def point_workloads(workload, num_points: int) -> list:
    """The workload of each point of a sweep, each with its own seed: one deployment
    serves every point, and prompts repeated across points would be prefix-cache hits.
    Rounds (fresh deployments) repeat the same points."""
    return [replace(workload, seed=workload.seed + POINT_SEED_STRIDE * i) for i in range(num_points)]


def _single(args, workload, slos: SLOSet, points, settings, config: dict) -> int:
    measured = asyncio.run(_measure(args.base_url, args, workload, points, settings, args.wait_ready))
    reports = [build_run_report(pt.label, pt.rate, results, slos) for pt, results in measured]
    classes = [c.name for c in workload.classes]
    slo_text = describe_slos(slos, classes)
    print(f"target {args.base_url}, workload {workload.name}, SLO: {slo_text}\n")
    print("\n\n".join(format_run(r) for r in reports))
    _write_json(args.json, {"config": config, "mode": "single", "target": args.base_url,
                            "slo": {**slos.as_dict(), "source": "none" if slos.is_empty() else "given"},
                            "runs": reports})
    if args.plot:
        from .plots import plot_goodput_vs_rate, plot_latency_cdfs

        files = plot_latency_cdfs({pt.label: res for pt, res in measured}, args.plot)
        if len(points) > 1:
            files.append(plot_goodput_vs_rate({"target": reports}, args.plot, slo_text))
        print(f"\nplots: {', '.join(str(f) for f in files)}")
    if not any(r["overall"]["num_ok"] for r in reports):
        print("error: no request succeeded", file=sys.stderr)
        return 1
    return 0


def _compare(args, workload, slos: SLOSet, points, settings, config: dict) -> int:
    specs = {"A": args.compare[0], "B": args.compare[1]}
    stems = {t: p.stem for t, p in specs.items()}
    names = stems if stems["A"] != stems["B"] else {"A": "A", "B": "B"}
    run_root = args.run_dir or Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
    measured: dict[str, list[Measured]] = {"A": [], "B": []}
    for i, (target, rnd) in enumerate(round_order(args.rounds)):
        port = args.port + i if args.port else free_port()
        print(f"== round {rnd + 1}/{args.rounds}: {names[target]} ({specs[target]}) on port {port}",
              flush=True)
        echo = (lambda line: None) if args.no_progress else \
            (lambda line: print(f"  [pdserve up] {line}", file=sys.stderr, flush=True))
        with Deployment(specs[target], port, run_root / f"{names[target]}-{rnd + 1}",
                        args.up_timeout, log=echo) as dep:
            m = asyncio.run(_measure(dep.base_url, args, workload, points, settings, args.up_timeout))
        measured[target].append(m)
        for pt, results in m:
            print(format_run(build_run_report(pt.label, pt.rate, results, slos), names[target]) + "\n")
    source = "given"
    if slos.is_empty():
        ref = slo_reference(points, args.slo_from)
        slos = derive_slo([m[ref][1] for m in measured["B"]])
        at = f" at {points[ref].label}" if len(points) > 1 else ""
        source = f"derived from {names['B']} (baseline) medians{at}"
    slo_text = f"{describe_slos(slos, [c.name for c in workload.classes])} ({source})"
    reports = {t: [[build_run_report(pt.label, pt.rate, res, slos) for pt, res in m] for m in rounds]
               for t, rounds in measured.items()}
    medians = {t: [median_metrics([key_metrics(rs[i]) for rs in reports[t]]) for i in range(len(points))]
               for t in reports}
    rows = [row for i, pt in enumerate(points) for row in ratio_rows(
        medians["A"][i], medians["B"][i], prefix=f"{pt.label}: " if len(points) > 1 else "")]
    print(f"== {names['A']} vs {names['B']}: median of {args.rounds} round(s)")
    print(format_compare(rows, (names["A"], names["B"]), slo_text))
    _write_json(args.json, {
        "config": config, "mode": "compare", "slo": {**slos.as_dict(), "source": source},
        "targets": {names[t]: {"spec": str(specs[t]), "rounds": reports[t], "median": medians[t]}
                    for t in ("A", "B")},
        "ratios": [{**r, "a_name": names["A"], "b_name": names["B"]} for r in rows]})
    if args.plot:
        from .plots import plot_goodput_vs_rate, plot_latency_cdfs

        series = {f"{names[t]}{f' @ {pt.label}' if len(points) > 1 else ''}":
                  [r for m in measured[t] for r in m[i][1]]
                  for t in ("A", "B") for i, pt in enumerate(points)}
        files = plot_latency_cdfs(series, args.plot)
        if len(points) > 1:
            sweep = {names[t]: [{"rate": pt.rate, "overall": {"goodput_rps": medians[t][i]["goodput req/s"],
                                                              "throughput_rps": medians[t][i]["throughput req/s"]}}
                                for i, pt in enumerate(points)] for t in ("A", "B")}
            files.append(plot_goodput_vs_rate(sweep, args.plot, slo_text))
        print(f"\nplots: {', '.join(str(f) for f in files)}")
    return 0


def slo_reference(points: list[Point], rate: float | None) -> int:
    """Index of the sweep point the SLO is derived at: ``rate``'s, else the first."""
    if rate is None:
        return 0
    for i, pt in enumerate(points):
        if pt.rate is not None and abs(pt.rate - rate) < 1e-9:
            return i
    raise WorkloadError(f"--slo-from {rate:g}: not a rate of this sweep")


def _write_json(path: Path | None, doc: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"\nreport: {path}")
