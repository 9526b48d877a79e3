"""``--plot DIR``: PNG figures of a bench or a comparison, drawn headless (Agg).

Owns the figures: the ITL CDF and the TTFT CDF (one curve per target and sweep
point) and, for rate sweeps, goodput (solid) and throughput (dashed) against the
offered request rate, one colour per target. Inputs are plain lists of
milliseconds and report dicts, so nothing here knows about HTTP or timing.
matplotlib is imported on first use: a bench without ``--plot`` never loads it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from .stats import RequestResult

Series = dict[str, list[RequestResult]]
"""Curve label (target, sweep point) -> the results it is drawn from."""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(plt, values_ms: dict[str, list[float]], title: str, xlabel: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in values_ms.items():
        if not values:
            continue
        xs = sorted(values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction <= x")
    ax.set_ylim(0, 1.01)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if any(values_ms.values()):
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_cdfs(series: Series, out_dir: Path) -> list[Path]:
    """ITL and TTFT CDFs of successful requests; returns the files written."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    itl = {label: [g * 1000.0 for r in results if r.is_ok for g in r.itls_s()]
           for label, results in series.items()}
    ttft = {label: [r.ttft_s * 1000.0 for r in results if r.is_ok and r.ttft_s is not None]
            for label, results in series.items()}
    return [_cdf(plt, itl, "Inter-token latency CDF", "ITL (ms, log)", out_dir / "itl_cdf.png"),
            _cdf(plt, ttft, "Time to first token CDF", "TTFT (ms, log)", out_dir / "ttft_cdf.png")]


def plot_goodput_vs_rate(points: dict[str, list[dict]], out_dir: Path, slo_text: str) -> Path:
    """``points``: target -> its run reports (with ``rate``), in sweep order."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (target, reports) in enumerate(points.items()):
        rated = [r for r in reports if r.get("rate") is not None]
        rates = [r["rate"] for r in rated]
        colour = f"C{i}"
        ax.plot(rates, [r["overall"]["goodput_rps"] for r in rated], "o-", color=colour,
                label=f"{target} goodput")
        ax.plot(rates, [r["overall"]["throughput_rps"] for r in rated], "x--", color=colour,
                alpha=0.6, label=f"{target} throughput")
    top = max((r.get("rate") or 0 for reports in points.values() for r in reports), default=1)
    ax.plot([0, top], [0, top], ":", color="grey", linewidth=1, label="offered")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("req/s")
    ax.set_title("Goodput vs request rate\n" + textwrap.fill(f"SLO: {slo_text}", 100), fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "goodput_vs_rate.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
