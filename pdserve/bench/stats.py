"""What one request measured, and the pure statistics over many: percentiles, goodput.

Owns ``RequestResult`` (filled in by the client, read by everything else), the SLO
types and ``summarize_run``, which turns a run's results into its report dict. No
I/O and no clocks here: every number is derived from the recorded timestamps, so
the unit tests feed synthetic ones.

Definitions (all per request, from ``time.perf_counter`` stamps taken by the client):
  - TTFT: first token-bearing chunk - send.
  - E2E: end of stream - send.
  - TPOT: (E2E - TTFT) / (output tokens - 1); undefined for one output token.
  - ITL: gaps between consecutive token-bearing chunks. When every chunk says how
    many tokens it carries (``token_ids``) a chunk of k tokens after a gap g counts
    as k gaps of g/k, so percentiles are per token; otherwise each chunk gap counts
    once. Tokens that arrive with the first chunk are inside TTFT, not ITL.
  - max ITL (the SLO's "no stall longer than"): the longest raw chunk gap, never
    divided, because that is what a reader of the stream waits.
  - output tokens: the server's ``usage.completion_tokens`` when it sent usage,
    else the sum of the per-chunk counts.
A request is good when it succeeded and met every threshold its class's SLO sets;
goodput = good requests / run duration (first send to last completion).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

QUANTILES: tuple[tuple[str, float], ...] = (
    ("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9), ("max", 100.0))


@dataclass
class RequestResult:
    class_name: str
    max_tokens: int
    start_s: float
    end_s: float = 0.0
    error: str | None = None
    """None on success; else the HTTP status ("503"), "stream_error", "timeout", ..."""
    error_detail: str = ""
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    has_exact_tokens: bool = True
    """True when every chunk carried ``token_ids`` (so ``chunk_tokens`` is exact)."""
    usage_prompt_tokens: int | None = None
    usage_output_tokens: int | None = None
    planned_prompt_tokens: int | None = None

    @property
    def is_ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        if self.usage_output_tokens is not None:
            return self.usage_output_tokens
        return sum(self.chunk_tokens)

    @property
    def prompt_tokens(self) -> int | None:
        return self.usage_prompt_tokens if self.usage_prompt_tokens is not None \
            else self.planned_prompt_tokens

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.start_s if self.chunk_times_s else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        ttft, n = self.ttft_s, self.output_tokens
        return None if ttft is None or n < 2 else (self.e2e_s - ttft) / (n - 1)

    def chunk_gaps_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def itls_s(self) -> list[float]:
        gaps = self.chunk_gaps_s()
        if not self.has_exact_tokens:
            return gaps
        out: list[float] = []
        for gap, k in zip(gaps, self.chunk_tokens[1:], strict=False):
            k = max(k, 1)
            out.extend([gap / k] * k)
        return out

    @property
    def max_itl_s(self) -> float | None:
        gaps = self.chunk_gaps_s()
        return max(gaps) if gaps else None


@dataclass(frozen=True)
class SLO:
    """Thresholds in milliseconds; None means "not part of this SLO"."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    max_itl_ms: float | None = None

    def is_empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.max_itl_ms is None

    def merged_over(self, base: SLO) -> SLO:
        """This SLO's thresholds, falling back to ``base`` where this one sets none."""
        return SLO(*(mine if mine is not None else theirs
                     for mine, theirs in zip(self.as_tuple(), base.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple[float | None, float | None, float | None]:
        return self.ttft_ms, self.tpot_ms, self.max_itl_ms

    def as_dict(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "max_itl_ms": self.max_itl_ms}

    def describe(self) -> str:
        parts = [f"{name} <= {value:g} ms" for name, value in
                 zip(("ttft", "tpot", "max itl"), self.as_tuple(), strict=True) if value is not None]
        return ", ".join(parts) or "none"


@dataclass(frozen=True)
class SLOSet:
    """One default SLO plus per-class overrides (a class's value wins where it sets one)."""

    default: SLO = SLO()
    per_class: dict[str, SLO] = field(default_factory=dict)

    def for_class(self, name: str) -> SLO:
        return self.per_class.get(name, SLO()).merged_over(self.default)

    def is_empty(self) -> bool:
        return self.default.is_empty() and all(s.is_empty() for s in self.per_class.values())

    def as_dict(self) -> dict:
        return {"default": self.default.as_dict(),
                "per_class": {k: v.as_dict() for k, v in self.per_class.items()}}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    return float(np.percentile(values, q))


def summarize(values_s: list[float]) -> dict[str, float | int | None]:
    """Percentiles and mean in milliseconds; every field None when there are no values."""
    if not values_s:
        return {"count": 0, "mean": None, **{name: None for name, _ in QUANTILES}}
    ms = np.asarray(values_s) * 1000.0
    points = np.percentile(ms, [q for _, q in QUANTILES])
    return {"count": len(ms), "mean": float(ms.mean()),
            **{name: float(v) for (name, _), v in zip(QUANTILES, points, strict=True)}}


def meets_slo(result: RequestResult, slo: SLO) -> bool:
    """Succeeded and met every threshold ``slo`` sets (an undefined metric cannot miss)."""
    if not result.is_ok:
        return False
    checks = ((slo.ttft_ms, result.ttft_s), (slo.tpot_ms, result.tpot_s),
              (slo.max_itl_ms, result.max_itl_s))
    return all(limit is None or value is None or value * 1000.0 <= limit
               for limit, value in checks)


def group_by_class(results: list[RequestResult]) -> dict[str, list[RequestResult]]:
    groups: dict[str, list[RequestResult]] = {}
    for r in results:
        groups.setdefault(r.class_name, []).append(r)
    return dict(sorted(groups.items()))


def run_duration_s(results: list[RequestResult]) -> float:
    """First send to last completion; 0 for no results."""
    if not results:
        return 0.0
    return max(r.end_s for r in results) - min(r.start_s for r in results)


def summarize_group(results: list[RequestResult], slos: SLOSet, duration_s: float) -> dict:
    """Counts, throughput, goodput and latency percentiles of one group of requests."""
    ok = [r for r in results if r.is_ok]
    num_good = sum(meets_slo(r, slos.for_class(r.class_name)) for r in results)
    out_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return {
        "num_sent": len(results),
        "num_ok": len(ok),
        "num_errors": len(results) - len(ok),
        "errors": dict(sorted(Counter(r.error for r in results if not r.is_ok).items())),
        "num_good": num_good,
        "num_short": sum(r.output_tokens < r.max_tokens for r in ok),
        "throughput_rps": per_s(len(ok)),
        "output_tok_s": per_s(out_tokens),
        "goodput_rps": per_s(num_good),
        "ttft_ms": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": summarize([g for r in ok for g in r.itls_s()]),
        "max_itl_ms": summarize([r.max_itl_s for r in ok if r.max_itl_s is not None]),
        "tpot_ms": summarize([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_ms": summarize([r.e2e_s for r in ok]),
    }


def summarize_run(results: list[RequestResult], slos: SLOSet) -> dict:
    """The report of one run: overall, then per class (each judged by its own SLO)."""
    duration_s = run_duration_s(results)
    classes = group_by_class(results)
    return {
        "duration_s": duration_s,
        "slo": {name: slos.for_class(name).as_dict() for name in classes},
        "overall": summarize_group(results, slos, duration_s),
        "classes": {name: summarize_group(group, slos, duration_s)
                    for name, group in classes.items()},
    }
