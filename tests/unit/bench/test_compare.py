"""The A/B protocol without clusters: round order, SLO derivation, medians, ratios, and
the start/stop handshake with a stand-in for ``pdserve up``."""

from __future__ import annotations

import sys
import textwrap

import pytest

from pdserve.bench.compare import (
    MAX_ITL_MS,
    Deployment,
    DeploymentError,
    derive_slo,
    key_metrics,
    median_metrics,
    ratio_rows,
    round_order,
)
from pdserve.bench.report import build_run_report
from pdserve.bench.stats import SLO, RequestResult, SLOSet
from pdserve.bench.workload import WorkloadError


def streamed(ttft_ms: float, gap_ms: float, n: int = 5, cls: str = "chat") -> RequestResult:
    times = [ttft_ms / 1000 + i * gap_ms / 1000 for i in range(n)]
    return RequestResult(cls, n, start_s=0.0, end_s=times[-1], chunk_times_s=times,
                         chunk_tokens=[1] * n)


def test_rounds_alternate_a_and_b():
    assert round_order(2) == [("A", 0), ("B", 0), ("A", 1), ("B", 1)]
    assert round_order(1) == [("A", 0), ("B", 0)]


def test_slo_is_derived_from_the_baseline_medians_per_class():
    round1 = [streamed(100, 10), streamed(300, 30), streamed(200, 20), streamed(1000, 5, cls="long")]
    round2 = [streamed(140, 14), streamed(140, 14), streamed(1400, 5, cls="long"),
              RequestResult("chat", 5, 0.0, 0.1, error="503")]  # failures do not move the SLO
    slos = derive_slo([round1, round2])
    # chat: TTFT p50 per round 200 and 140 -> median 170 -> x2; TPOT p50 20 and 14 -> 17 -> x1.5
    assert slos.for_class("chat") == SLO(ttft_ms=pytest.approx(340.0), tpot_ms=pytest.approx(25.5),
                                         max_itl_ms=MAX_ITL_MS)
    assert slos.for_class("long").ttft_ms == pytest.approx(2 * 1200.0)
    assert slos.for_class("long").max_itl_ms == MAX_ITL_MS


def test_medians_across_rounds_and_ratios_a_over_b():
    slos = SLOSet(default=SLO(ttft_ms=250.0))
    a_rounds = [build_run_report("r", None, [streamed(t, 10) for t in ttfts], slos)
                for ttfts in ([100, 100], [100, 300], [100, 100])]
    b_rounds = [build_run_report("r", None, [streamed(t, 20) for t in ttfts], slos)
                for ttfts in ([200, 400], [200, 400])]
    a = median_metrics([key_metrics(r) for r in a_rounds])
    b = median_metrics([key_metrics(r) for r in b_rounds])
    assert a["ttft p50 chat ms"] == pytest.approx(100.0)
    assert b["ttft p50 chat ms"] == pytest.approx(300.0)
    rows = {r["metric"]: r for r in ratio_rows(a, b)}
    assert rows["ttft p50 chat ms"]["ratio"] == pytest.approx(1 / 3)
    assert rows["tpot p50 ms"]["ratio"] == pytest.approx(0.5)
    assert rows["errors"]["ratio"] is None  # 0 / 0 has no ratio
    assert {"goodput req/s", "itl p99.9 ms", "ttft p99 chat ms"} <= set(rows)


STAND_IN = textwrap.dedent("""
    import signal, sys, time
    print("starting cluster", flush=True)
    time.sleep(0.2)
    print("pdserve is up: http://127.0.0.1:1  (Ctrl-C stops everything)", flush=True)
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    while True:
        time.sleep(0.05)
""")


def test_deployment_waits_for_the_up_line_and_stops_with_sigint(tmp_path):
    seen: list[str] = []
    dep = Deployment(tmp_path / "a.yaml", 1, tmp_path / "a-1", 10.0, log=seen.append,
                     argv=[sys.executable, "-c", STAND_IN])
    with dep:
        assert dep.is_up.is_set()
        assert dep.proc.poll() is None
    assert dep.proc.returncode == 0  # exited on SIGINT, not killed
    assert any("pdserve is up" in line for line in seen)
    assert (tmp_path / "a-1.out").read_text().startswith("starting cluster")


def test_a_deployment_that_exits_early_is_an_error_with_its_output(tmp_path):
    dep = Deployment(tmp_path / "a.yaml", 1, tmp_path / "a-1", 10.0,
                     argv=[sys.executable, "-c", "print('error: bad spec'); raise SystemExit(1)"])
    with pytest.raises(DeploymentError, match="bad spec"), dep:
        pass
    assert dep.proc.returncode == 1


def test_the_slo_is_derived_at_the_rate_asked_for():
    from pdserve.bench.cli import slo_reference
    from pdserve.bench.options import Point

    points = [Point(f"rate {r:g} req/s", r, None) for r in (1.0, 2.0, 3.0)]
    assert slo_reference(points, None) == 0
    assert slo_reference(points, 3.0) == 2
    with pytest.raises(WorkloadError, match="--slo-from 5"):
        slo_reference(points, 5.0)
