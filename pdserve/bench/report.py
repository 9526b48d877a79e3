"""What a run looks like on paper: the report dict (``--json``) and the terminal tables.

Owns the report's shape. A run report is ``stats.summarize_run`` plus the run's
label and rate, and one row per request (times relative to the run's first send).
Latencies are milliseconds everywhere in a report; ``None`` where a metric has no
samples (ITL of one-token answers). Pure: strings and dicts in, strings out.
"""

from __future__ import annotations

from .stats import QUANTILES, RequestResult, SLOSet, summarize_run

LATENCY_ROWS = (("ttft", "ttft_ms"), ("itl", "itl_ms"), ("max itl", "max_itl_ms"),
                ("tpot", "tpot_ms"), ("e2e", "e2e_ms"))


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)


def request_row(r: RequestResult, t0_s: float) -> dict:
    return {"class": r.class_name, "ok": r.is_ok, "error": r.error,
            **({"error_detail": r.error_detail} if r.error_detail else {}),
            "sent_at_s": round(r.start_s - t0_s, 6), "ttft_ms": _ms(r.ttft_s),
            "tpot_ms": _ms(r.tpot_s), "max_itl_ms": _ms(r.max_itl_s), "e2e_ms": _ms(r.e2e_s),
            "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
            "max_tokens": r.max_tokens, "num_chunks": len(r.chunk_times_s),
            "exact_chunk_tokens": r.has_exact_tokens}


def build_run_report(label: str, rate: float | None, results: list[RequestResult],
                     slos: SLOSet) -> dict:
    """Called once per run (and again in compare mode, once the SLO is known)."""
    t0 = min((r.start_s for r in results), default=0.0)
    return {"label": label, "rate": rate, **summarize_run(results, slos),
            "requests": [request_row(r, t0) for r in sorted(results, key=lambda r: r.start_s)]}


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned first column, right-aligned others, two spaces apart."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    def line(row: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _describe_slo(slo: dict) -> str:
    parts = [f"{name} <= {slo[key]:g} ms" for name, key in
             (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("max itl", "max_itl_ms"))
             if slo.get(key) is not None]
    return ", ".join(parts) or "none"


def format_run(report: dict, target: str | None = None) -> str:
    """The terminal view of one run: counts and goodput per class, then latency percentiles."""
    o = report["overall"]
    title = f"{target}: " if target else ""
    head = (f"{title}{report['label']}: {o['num_sent']} sent, {o['num_ok']} ok, "
            f"{o['num_errors']} errors in {report['duration_s']:.1f}s")
    if o["errors"]:
        head += " (" + ", ".join(f"{k}: {v}" for k, v in o["errors"].items()) + ")"
    groups = [("all", o), *report["classes"].items()] if len(report["classes"]) > 1 else \
        [(next(iter(report["classes"]), "all"), o)]
    counts = [[name, str(g["num_sent"]), str(g["num_ok"]), str(g["num_errors"]),
               _fmt(g["throughput_rps"], 2), _fmt(g["output_tok_s"]), _fmt(g["goodput_rps"], 2),
               "" if name == "all" else _describe_slo(report["slo"][name])]
              for name, g in groups]
    count_table = table(["class", "sent", "ok", "err", "req/s", "out tok/s", "goodput/s", "SLO"],
                        counts)
    latency = [[f"{metric} {name}", str(g[key]["count"]),
                *(_fmt(g[key][q]) for q, _ in QUANTILES)]
               for metric, key in LATENCY_ROWS for name, g in groups]
    latency_table = table(["ms", "n", *(q for q, _ in QUANTILES)], latency)
    notes = []
    if o["num_short"]:
        notes.append(f"note: {o['num_short']} answers were shorter than asked "
                     f"(the server ignored min_tokens/ignore_eos)")
    return "\n".join([head, "", count_table, "", latency_table, *notes])


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def format_compare(rows: list[dict], names: tuple[str, str], slo_text: str) -> str:
    """``rows`` from ``compare.ratio_rows``: metric, value A, value B, A/B."""
    a, b = names
    body = [[r["metric"], _fmt(r["a"], 2), _fmt(r["b"], 2), _fmt(r["ratio"], 3)] for r in rows]
    return "\n".join([f"SLO: {slo_text}", "", table(["metric", a, b, f"{a}/{b}"], body)])
