"""``pdserve bench`` against a real local cluster: every request is accounted for, the
report is complete and self-consistent, and the PNGs are written. ``--compare`` brings
up two tiny clusters one after the other and prints A/B ratios. No timing thresholds:
only orders and counts, which hold on any machine."""

from __future__ import annotations

import json
import signal
import subprocess

from tests.etcd import free_port
from tests.procs import PDSERVE, REPO, Proc

NUM_REQUESTS, OUTPUT_TOKENS = 12, 8
QUANTILES = ("p50", "p90", "p99", "p99.9", "max")
TINY_SPEC = """apiVersion: pdserve.io/v1alpha1
kind: PDCluster
metadata:
  name: {name}
spec:
  model:
    preset: tiny
  prefill:
    replicas: 1
  decode:
    replicas: 1
  kvTransfer:
    mode: layerwise
    transport: tcp
"""
COLOCATED_SPEC = """apiVersion: pdserve.io/v1alpha1
kind: PDCluster
metadata:
  name: {name}
spec:
  model:
    preset: tiny
  prefill:
    replicas: 0
  decode:
    replicas: 0
  hybrid:
    replicas: 2
"""


def bench(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([*PDSERVE, "bench", "--no-progress", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=timeout_s)


def assert_ordered(summary: dict) -> None:
    values = [summary[q] for q in QUANTILES]
    assert all(v is not None for v in values), summary
    assert values == sorted(values), summary


def test_bench_reports_every_request_of_a_short_run(tmp_path):
    port = free_port()
    up = Proc([*PDSERVE, "up", "--model", "tiny", "--port", str(port), "--run-dir", str(tmp_path / "run")])
    try:
        up.wait_for(r"pdserve is up", timeout_s=180)
        done = bench("--base-url", f"http://127.0.0.1:{port}", "--wait-ready", "60",
                     "--num-requests", str(NUM_REQUESTS), "--concurrency", "2",
                     "--prompt-tokens", "uniform:8:24", "--output-tokens", str(OUTPUT_TOKENS),
                     "--slo-ttft-ms", "60000", "--slo-tpot-ms", "10000",
                     "--json", str(tmp_path / "report.json"), "--plot", str(tmp_path / "plots"),
                     timeout_s=120)
        assert done.returncode == 0, done.stdout + done.stderr
        up.popen.send_signal(signal.SIGINT)
        assert up.popen.wait(30) == 0
    finally:
        up.stop()
    assert "Traceback" not in done.stderr
    assert "goodput" in done.stdout and "ttft" in done.stdout

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["mode"] == "single" and report["config"]["args"]["num_requests"] == NUM_REQUESTS
    (run,) = report["runs"]
    overall = run["overall"]
    assert overall["num_sent"] == NUM_REQUESTS
    assert overall["num_ok"] + overall["num_errors"] == overall["num_sent"]
    assert overall["num_errors"] == 0, overall["errors"]
    assert len(run["requests"]) == NUM_REQUESTS
    for req in run["requests"]:
        assert req["ok"] and req["output_tokens"] == req["max_tokens"] == OUTPUT_TOKENS, req
        assert req["ttft_ms"] > 0 and req["e2e_ms"] >= req["ttft_ms"]
        assert 8 <= req["prompt_tokens"] <= 24
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "max_itl_ms"):
        assert_ordered(overall[key])
    assert overall["ttft_ms"]["p50"] > 0
    assert overall["itl_ms"]["count"] == NUM_REQUESTS * (OUTPUT_TOKENS - 1)
    assert 0 <= overall["goodput_rps"] <= overall["throughput_rps"]
    assert overall["output_tok_s"] > 0 and run["duration_s"] > 0
    assert list(run["classes"]) == ["default"]
    for name in ("itl_cdf.png", "ttft_cdf.png"):
        png = tmp_path / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_compare_runs_both_specs_and_prints_ratios(tmp_path):
    specs = []
    # What a user compares: PD against the colocated baseline (a hybrid-only spec).
    for name, text in (("pd", TINY_SPEC), ("ref", COLOCATED_SPEC)):
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(text.format(name=f"bench-{name}"))
        specs.append(str(spec))
    done = bench("--compare", *specs, "--rounds", "1", "--run-dir", str(tmp_path / "runs"),
                 "--num-requests", "6", "--concurrency", "2", "--prompt-tokens", "16",
                 "--output-tokens", "4", "--json", str(tmp_path / "compare.json"),
                 "--up-timeout", "120", timeout_s=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pd/ref" in done.stdout
    assert "derived from ref (baseline) medians" in done.stdout

    report = json.loads((tmp_path / "compare.json").read_text())
    assert report["mode"] == "compare" and report["slo"]["source"].startswith("derived")
    assert report["slo"]["default"]["max_itl_ms"] == 250.0
    assert report["slo"]["per_class"]["default"]["ttft_ms"] > 0
    for name in ("pd", "ref"):
        (rounds,) = report["targets"][name]["rounds"]
        (run,) = rounds
        assert run["overall"]["num_sent"] == 6 and run["overall"]["num_errors"] == 0
    ratios = {r["metric"]: r for r in report["ratios"]}
    assert {"goodput req/s", "ttft p50 default ms", "ttft p99 default ms", "itl p50 ms",
            "itl p99 ms", "itl p99.9 ms", "tpot p50 ms"} <= set(ratios)
    assert ratios["ttft p50 default ms"]["ratio"] > 0
    assert "2 hybrid, colocated" in (tmp_path / "runs" / "ref-1.out").read_text()
    # every deployment was stopped: pdserve up removes its process list on a clean exit
    for run_dir in ("pd-1", "ref-1"):
        assert not (tmp_path / "runs" / run_dir / "processes.json").exists()
