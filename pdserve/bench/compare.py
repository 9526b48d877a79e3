"""``--compare A.yaml B.yaml``: run two deployments on this machine, one at a time, same load.

Owns the A/B protocol. Each round starts A (``pdserve up -f A.yaml`` as a child
process, ready once it prints "pdserve is up" and answers a completion), runs the
workload, stops it (SIGINT, then wait for it to exit), then does the same for B;
rounds go A, B, A, B, ... so slow drift of the machine hits both. Per target the
rounds are aggregated by the median of each metric. Ratios are A/B: with A the PD
spec and B the colocated baseline, goodput > 1 and latencies < 1 mean PD wins.

SLO: the thresholds given (flags or the workload file); when none are given, they
are derived from the baseline (B) as DistServe does: per class TTFT <= 2x B's
median TTFT p50 and TPOT <= 1.5x B's median TPOT p50, and max ITL <= 250 ms.

Invariant: a started deployment is always stopped, whatever ends the run
(``Deployment`` is a context manager; its ``__exit__`` stops and reaps it).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .stats import SLO, RequestResult, SLOSet, group_by_class, percentile

TTFT_FACTOR = 2.0
TPOT_FACTOR = 1.5
MAX_ITL_MS = 250.0
UP_LINE = "pdserve is up"
STOP_TIMEOUT_S = 60.0


class DeploymentError(RuntimeError):
    """A deployment that did not come up; the message carries the tail of its output."""


def round_order(rounds: int) -> list[tuple[str, int]]:
    """A, B, A, B, ...: (target, round) in the order they run."""
    return [(target, r) for r in range(rounds) for target in ("A", "B")]


def derive_slo(baseline_rounds: list[list[RequestResult]]) -> SLOSet:
    """Per-class thresholds from the baseline's rounds (median across rounds of each p50)."""
    per_class: dict[str, SLO] = {}
    by_class: dict[str, list[list[RequestResult]]] = {}
    for results in baseline_rounds:
        for name, group in group_by_class(results).items():
            by_class.setdefault(name, []).append([r for r in group if r.is_ok])
    for name, rounds in by_class.items():
        ttft = [percentile([r.ttft_s for r in g if r.ttft_s is not None], 50) for g in rounds if g]
        tpot = [percentile(v, 50) for g in rounds if (v := [r.tpot_s for r in g if r.tpot_s is not None])]
        per_class[name] = SLO(
            ttft_ms=round(TTFT_FACTOR * statistics.median(ttft) * 1000.0, 1) if ttft else None,
            tpot_ms=round(TPOT_FACTOR * statistics.median(tpot) * 1000.0, 1) if tpot else None)
    return SLOSet(default=SLO(max_itl_ms=MAX_ITL_MS), per_class=per_class)


def key_metrics(report: dict) -> dict[str, float | None]:
    """The compared numbers of one run report, flat: metric name -> value."""
    o, classes = report["overall"], report["classes"]
    out: dict[str, float | None] = {"goodput req/s": o["goodput_rps"]}
    if len(classes) > 1:
        out.update({f"goodput {name} req/s": c["goodput_rps"] for name, c in classes.items()})
    for name, c in classes.items():
        out[f"ttft p50 {name} ms"] = c["ttft_ms"]["p50"]
        out[f"ttft p99 {name} ms"] = c["ttft_ms"]["p99"]
    out.update({f"itl {q} ms": o["itl_ms"][q] for q in ("p50", "p99", "p99.9")})
    out["tpot p50 ms"] = o["tpot_ms"]["p50"]
    out["throughput req/s"] = o["throughput_rps"]
    out["output tok/s"] = o["output_tok_s"]
    out["errors"] = float(o["num_errors"])
    return out


def median_metrics(per_round: list[dict[str, float | None]]) -> dict[str, float | None]:
    """The median across rounds of each metric (rounds where it is undefined are left out)."""
    names = list(dict.fromkeys(name for m in per_round for name in m))
    out: dict[str, float | None] = {}
    for name in names:
        values = [v for m in per_round if (v := m.get(name)) is not None]
        out[name] = statistics.median(values) if values else None
    return out


def ratio_rows(a: dict[str, float | None], b: dict[str, float | None], prefix: str = "") -> list[dict]:
    rows = []
    for name in dict.fromkeys([*a, *b]):
        va, vb = a.get(name), b.get(name)
        rows.append({"metric": f"{prefix}{name}", "a": va, "b": vb,
                     "ratio": None if va is None or vb in (None, 0) else va / vb})
    return rows


class Deployment:
    """One ``pdserve up -f SPEC --port PORT --run-dir DIR`` child process."""

    def __init__(self, spec: Path, port: int, run_dir: Path, up_timeout_s: float,
                 log: Callable[[str], None] = lambda line: None,
                 argv: list[str] | None = None) -> None:
        self.spec, self.port, self.run_dir, self.up_timeout_s = spec, port, run_dir, up_timeout_s
        self.log = log
        self.argv = argv or [sys.executable, "-m", "pdserve.cli", "up", "-f", str(spec),
                             "--port", str(port), "--run-dir", str(run_dir)]
        """The command; tests pass a stand-in that prints the same line."""
        self.lines: list[str] = []
        self.is_up = threading.Event()
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Deployment:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()
        try:
            self._wait_up()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.run_dir.with_name(self.run_dir.name + ".out"), "w") as out:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                out.write(line)
                out.flush()
                self.log(line.rstrip("\n"))
                if UP_LINE in line:
                    self.is_up.set()

    def _wait_up(self) -> None:
        deadline = time.monotonic() + self.up_timeout_s
        while not self.is_up.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                has_exited = self.proc.poll() is not None
                if has_exited:
                    self._pump_thread.join(2.0)  # its last lines say why
                why = f"exited with {self.proc.returncode}" if has_exited \
                    else f"not up after {self.up_timeout_s:g}s"
                tail = "\n".join(self.lines[-20:])
                raise DeploymentError(f"pdserve up -f {self.spec} {why}:\n{tail}")

    def stop(self) -> int | None:
        """SIGINT (``pdserve up`` then stops everything it started), wait; escalate if stuck."""
        if self.proc is None:
            return None
        for sig, wait_s in ((signal.SIGINT, STOP_TIMEOUT_S), (signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
            if self.proc.poll() is not None:
                break
            self.proc.send_signal(sig)
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        return self.proc.returncode
