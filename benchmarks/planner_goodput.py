"""Goodput with the SLO planner against every static P:D split of the same engines.

Each arm is a ``pdserve up -f`` cluster of three engines (the ``small`` preset, one
thread each) with the same SLO; ``pdserve bench`` then runs three phases back to back,
each a closed loop whose mix differs:

- prompt-heavy: 1024-token prompts, 8 output tokens, 6 streams: one prefill engine
  cannot keep the TTFT target;
- output-heavy: 32-token prompts, 256 output tokens, 96 streams: their KV does not fit
  one decode engine's cache (a CPU decode step costs nearly the same at any batch, so
  here the cache, not the step time, is what a second decode engine adds; the engines
  run up to 128 streams, ``maxNumSeqs``, so the cache binds first, not the default cap
  of 64 running streams, which a decode engine keeps);
- mixed: prompts of 64 to 1024 tokens, 8 to 128 output tokens, 8 streams.

Arms: ``1P+2D`` and ``2P+1D`` static (planner off and ``overloadSwitching: false``: no
role switch of any kind), and ``planner`` (starting at 1P+2D, ``spec.planner`` on, same
engine budget of three). Rounds alternate the arms'
order (A B C, then C B A). Goodput is the requests meeting both the TTFT and the TPOT
target per second of the phase; overall is all good requests over all phases' time.
After each phase the planner's action count is read from the Controller's view.

Rerun: .venv/bin/python benchmarks/planner_goodput.py --phase-seconds 90 --rounds 2 --json results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from pdserve.local.agents import get_view
from pdserve.local.runstate import RunState
from pdserve.local.up import TOKEN_FILE
from pdserve.runtime.security import SecuritySettings

PDSERVE = [sys.executable, "-m", "pdserve.cli"]
PHASES = {  # name: (prompt tokens, output tokens, concurrency)
    "prompt-heavy": ("1024", "8", 6),
    "output-heavy": ("32", "256", 96),
    "mixed": ("uniform:64:1024", "uniform:8:128", 8),
}
ARMS = {"1P+2D": (1, 2, False), "2P+1D": (2, 1, False), "planner": (1, 2, True)}


def spec(name: str, prefill: int, decode: int, planner: bool, ttft_ms: int, tpot_ms: int) -> dict:
    return {"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster", "metadata": {"name": name},
            "spec": {"model": {"preset": "small"}, "engine": {"dtype": "float32", "kvCacheBytes": "128Mi", "maxNumSeqs": 128},
                     "prefill": {"replicas": prefill, "threads": 1},
                     "decode": {"replicas": decode, "threads": 1},
                     "slo": {"ttftMs": ttft_ms, "tpotMs": tpot_ms},
                     # static arms: no role switch of any kind (the split is the arm's)
                     "planner": {"enabled": planner, "overloadSwitching": planner, "intervalSeconds": 2, "windowSeconds": 20,
                                 "stableIntervals": 2, "cooldownSeconds": 10, "minRequests": 5,
                                 "minPrefill": 1, "maxPrefill": 2, "minDecode": 1, "maxDecode": 2,
                                 "maxEngines": 3}}}


def run_arm(arm: str, args, workdir: Path, seed: int) -> dict:
    prefill, decode, planner = ARMS[arm]
    name = "bench-" + arm.lower().replace("+", "-")
    spec_file, run_dir = workdir / f"{name}.yaml", workdir / f"{name}-run-{seed}"
    spec_file.write_text(yaml.safe_dump(spec(name, prefill, decode, planner, args.ttft_ms, args.tpot_ms)))
    up = subprocess.Popen([*PDSERVE, "up", "-f", str(spec_file), "--port", str(args.port),
                           "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in up.stdout:
            if "pdserve is up" in line:
                break
        else:
            raise RuntimeError(f"{arm}: pdserve up ended before it was up")
        controller = RunState(run_dir).read_addresses()["controller"]
        security = SecuritySettings(token=(run_dir / TOKEN_FILE).read_text().strip())
        phases, actions_before = {}, 0
        stop = threading.Event()
        timeline = threading.Thread(target=_follow_planner, daemon=True, args=(
            controller, security, workdir / f"{name}-{seed}-planner.jsonl", stop))
        timeline.start()
        for k, (phase, (prompt, output, concurrency)) in enumerate(PHASES.items()):
            out = workdir / f"{name}-{seed}-{phase}.json"
            _mark(workdir / f"{name}-{seed}-planner.jsonl", phase)
            subprocess.run([*PDSERVE, "bench", "--base-url", f"http://127.0.0.1:{args.port}",
                            "--prompt-tokens", prompt, "--output-tokens", output,
                            "--concurrency", str(concurrency), "--duration", str(args.phase_seconds),
                            "--warmup", "0", "--seed", str(seed * 10 + k), "--vocab-size", "8000",
                            "--slo-ttft-ms", str(args.ttft_ms), "--slo-tpot-ms", str(args.tpot_ms),
                            "--json", str(out), "--no-progress"], check=True, capture_output=True, timeout=900)
            overall = json.loads(out.read_text())["runs"][0]["overall"]
            view = get_view(controller, security)
            actions = view.planner.num_actions if view is not None and view.HasField("planner") else 0
            phases[phase] = {"good": overall["num_good"], "sent": overall["num_sent"],
                             "errors": overall["num_errors"], "seconds": args.phase_seconds,
                             "goodput": overall["num_good"] / args.phase_seconds,
                             "ttft_p50_ms": overall["ttft_ms"].get("p50"), "tpot_p50_ms": overall["tpot_ms"].get("p50"),
                             "actions": actions - actions_before,
                             "split": _split(view)}
            actions_before = actions
            print(f"  {arm:8} {phase:13} goodput {phases[phase]['goodput']:.3f} req/s "
                  f"({phases[phase]['good']}/{phases[phase]['sent']} good, {phases[phase]['errors']} errors), "
                  f"TTFT p50 {phases[phase]['ttft_p50_ms']} ms, TPOT p50 {phases[phase]['tpot_p50_ms']} ms, "
                  f"actions {phases[phase]['actions']}, split after {phases[phase]['split']}", flush=True)
        stop.set()
        timeline.join(10)
        return phases
    finally:
        up.terminate()
        up.wait(120)


def _follow_planner(controller: str, security, path: Path, stop: threading.Event) -> None:
    """The planner's split, wants and reason every 2 s, one JSON line each (the workdir's
    ``*-planner.jsonl``: when it saw a phase change and why it acted or held)."""
    while not stop.wait(2.0):
        view = get_view(controller, security)
        if view is None or not view.HasField("planner"):
            continue
        p = view.planner
        with path.open("a") as f:
            f.write(json.dumps({"t": round(time.time(), 1), "split": _split(view),
                                "wanted": f"{p.wanted_prefill}P+{p.wanted_decode}D",
                                "ttft_s": round(p.measured_ttft_s, 3), "tpot_s": round(p.measured_tpot_s, 3),
                                "prefill_tok_s": round(p.prefill_tokens_per_s),
                                # per engine: role, requests waiting, prompt tokens waiting,
                                # KV blocks used / committed / total
                                "engines": [f"{i.role[0]} w{i.load.num_waiting} pt{i.load.num_waiting_prompt_tokens} "
                                            f"kv{i.load.num_kv_blocks_used}/{i.load.num_kv_blocks_committed}/"
                                            f"{i.load.num_kv_blocks_used + i.load.num_kv_blocks_free}"
                                            for i in view.instances],
                                "reason": p.reason}) + "\n")


def _mark(path: Path, phase: str) -> None:
    with path.open("a") as f:
        f.write(json.dumps({"t": round(time.time(), 1), "phase": phase}) + "\n")


def _split(view) -> str:
    if view is None:
        return "?"
    roles = [i.role for i in view.instances]
    return f"{roles.count('prefill')}P+{roles.count('decode')}D"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase-seconds", type=float, default=90.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ttft-ms", type=int, default=2500)
    p.add_argument("--tpot-ms", type=int, default=100)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--output-streams", type=int, default=PHASES["output-heavy"][2],
                   help="concurrent streams of the output-heavy phase")
    p.add_argument("--arms", default=",".join(ARMS), help="the arms to run, comma-separated (a probe)")
    p.add_argument("--json", type=Path, help="write every arm's phases")
    p.add_argument("--workdir", type=Path, help="keep the specs, logs and reports here (default: a temporary one)")
    args = p.parse_args()
    PHASES["output-heavy"] = (*PHASES["output-heavy"][:2], args.output_streams)
    arms = [a for a in ARMS if a in args.arms.split(",")]
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="planner-goodput-") as tmp:
        tmp = args.workdir or tmp
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for r in range(args.rounds):
            order = arms if r % 2 == 0 else list(reversed(arms))
            print(f"round {r + 1}: {', '.join(order)}", flush=True)
            for arm in order:
                results[arm].append(run_arm(arm, args, Path(tmp), seed=r + 1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nSLO: TTFT {args.ttft_ms} ms, TPOT {args.tpot_ms} ms; {args.phase_seconds:g} s per phase; "
          "goodput req/s, rounds separated by ' / '\n")
    print("| arm | " + " | ".join(PHASES) + " | overall | planner actions per phase |")
    print("|---|" + "---:|" * (len(PHASES) + 1) + "---|")
    for arm, rounds in results.items():
        cells = [" / ".join(f"{rd[ph]['goodput']:.3f}" for rd in rounds) for ph in PHASES]
        overall = [sum(rd[ph]["good"] for ph in PHASES) / sum(rd[ph]["seconds"] for ph in PHASES) for rd in rounds]
        actions = " / ".join(",".join(str(rd[ph]["actions"]) for ph in PHASES) for rd in rounds)
        print(f"| {arm} | " + " | ".join(cells) + f" | {' / '.join(f'{o:.3f}' for o in overall)} | {actions} |")
    statics = [a for a in arms if not ARMS[a][2]]
    if "planner" in results and statics:
        best_static = max(statistics.median(sum(rd[ph]["good"] for ph in PHASES) for rd in results[a])
                          for a in statics)
        planner = statistics.median(sum(rd[ph]["good"] for ph in PHASES) for rd in results["planner"])
        print(f"\nplanner / best static split, overall (median good requests): {planner / best_static:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
