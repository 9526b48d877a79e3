"""The bench's statistics on synthetic timestamps: percentiles, per-request metrics, goodput."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench.stats import (
    SLO,
    RequestResult,
    SLOSet,
    meets_slo,
    percentile,
    summarize,
    summarize_run,
)

MS = 1e-3


def streamed(gaps_ms: list[float], ttft_ms: float = 100.0, start_s: float = 10.0,
             tail_ms: float = 0.0, tokens: list[int] | None = None, exact: bool = True,
             cls: str = "chat", usage: int | None = None) -> RequestResult:
    """A request sent at ``start_s`` whose chunks arrive after ``ttft_ms`` and then ``gaps_ms``."""
    times = [start_s + ttft_ms * MS]
    for gap in gaps_ms:
        times.append(times[-1] + gap * MS)
    tokens = tokens or [1] * len(times)
    n_out = usage if usage is not None else sum(tokens)
    return RequestResult(cls, max_tokens=n_out, start_s=start_s, end_s=times[-1] + tail_ms * MS,
                         chunk_times_s=times, chunk_tokens=tokens, has_exact_tokens=exact,
                         usage_output_tokens=usage)


def failed(status: str = "503", cls: str = "chat", start_s: float = 10.0) -> RequestResult:
    return RequestResult(cls, max_tokens=8, start_s=start_s, end_s=start_s + 0.01, error=status)


def test_percentile_interpolates_linearly_between_ranks():
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 100) == 10.0
    assert percentile([7.0], 99.9) == 7.0
    rng = np.random.default_rng(0)
    sample = rng.lognormal(size=999).tolist()
    for q in (50, 90, 99, 99.9):
        assert percentile(sample, q) == pytest.approx(float(np.percentile(sample, q)))
    with pytest.raises(ValueError):
        percentile([], 50)


def test_known_itl_list_gives_known_p99_and_max():
    # 100 gaps: 98 of 10 ms, one of 20 ms, one stall of 1010 ms.
    r = streamed([10.0] * 49 + [1010.0] + [10.0] * 49 + [20.0])
    report = summarize_run([r], SLOSet())
    itl = report["overall"]["itl_ms"]
    assert itl["count"] == 100
    assert itl["p50"] == pytest.approx(10.0)
    # rank 0.99 * 99 = 98.01: 20 + 0.01 * (1010 - 20)
    assert itl["p99"] == pytest.approx(29.9)
    assert itl["max"] == pytest.approx(1010.0)
    assert r.max_itl_s == pytest.approx(1.010)


def test_ttft_tpot_e2e_of_one_request():
    r = streamed([20.0] * 7, ttft_ms=150.0, tail_ms=2.0)  # 8 tokens
    assert r.output_tokens == 8
    assert r.ttft_s == pytest.approx(0.150)
    assert r.e2e_s == pytest.approx(0.150 + 0.140 + 0.002)
    assert r.tpot_s == pytest.approx((0.140 + 0.002) / 7)


def test_a_chunk_of_several_tokens_spreads_its_gap_only_when_counts_are_exact():
    exact = streamed([30.0, 10.0], tokens=[2, 3, 1])
    # first chunk's extra token is inside TTFT; 30 ms over 3 tokens, then one 10 ms gap
    assert [g * 1000 for g in exact.itls_s()] == pytest.approx([10.0, 10.0, 10.0, 10.0])
    assert exact.max_itl_s == pytest.approx(0.030)  # a reader waited the whole 30 ms
    assert exact.output_tokens == 6
    text_only = streamed([30.0, 10.0], exact=False, usage=6)
    assert [g * 1000 for g in text_only.itls_s()] == pytest.approx([30.0, 10.0])
    assert text_only.output_tokens == 6  # from usage, not from the 3 chunks


def test_missing_tpot_by_one_ms_is_not_good():
    slo = SLO(tpot_ms=20.0)
    on_target = streamed([19.5] * 9)  # tpot 19.5 ms
    one_ms_over = streamed([21.0] * 9)  # tpot 21 ms
    assert one_ms_over.tpot_s == pytest.approx(0.021)
    assert meets_slo(on_target, slo)
    assert not meets_slo(one_ms_over, slo)
    report = summarize_run([on_target, one_ms_over], SLOSet(default=slo))
    assert report["overall"]["num_good"] == 1
    assert report["overall"]["num_ok"] == 2


def test_failed_requests_count_as_errors_never_as_good():
    results = [streamed([10.0] * 3), failed("503"), failed("503"), failed("timeout")]
    overall = summarize_run(results, SLOSet())["overall"]
    assert overall["num_sent"] == 4
    assert overall["num_ok"] == 1
    assert overall["num_errors"] == 3
    assert overall["errors"] == {"503": 2, "timeout": 1}
    assert overall["num_good"] == 1
    assert overall["ttft_ms"]["count"] == 1  # latencies only of successful requests
    assert not meets_slo(failed(), SLO())


def test_goodput_is_good_requests_per_second_of_the_run():
    # two requests sent 1 s apart, each lasting 1 s (ttft 100 ms): the run lasts 2 s
    fast = streamed([100.0] * 9, ttft_ms=100.0, start_s=0.0)
    slow = streamed([100.0] * 9, ttft_ms=900.0, start_s=1.0, tail_ms=0.0)
    slow.end_s = 2.0
    report = summarize_run([fast, slow], SLOSet(default=SLO(ttft_ms=500.0)))
    assert report["duration_s"] == pytest.approx(2.0)
    overall = report["overall"]
    assert overall["throughput_rps"] == pytest.approx(1.0)
    assert overall["goodput_rps"] == pytest.approx(0.5)
    assert overall["goodput_rps"] <= overall["throughput_rps"]
    assert overall["output_tok_s"] == pytest.approx(20 / 2.0)


def test_each_class_is_judged_by_its_own_slo():
    chat = streamed([10.0] * 3, ttft_ms=150.0, cls="chat")
    long = streamed([10.0] * 3, ttft_ms=1500.0, cls="long")
    slos = SLOSet(default=SLO(ttft_ms=200.0, max_itl_ms=250.0), per_class={"long": SLO(ttft_ms=2000.0)})
    assert slos.for_class("long") == SLO(ttft_ms=2000.0, max_itl_ms=250.0)
    report = summarize_run([chat, long], slos)
    assert report["overall"]["num_good"] == 2
    assert set(report["classes"]) == {"chat", "long"}
    assert report["classes"]["long"]["num_good"] == 1
    assert report["slo"]["long"]["ttft_ms"] == 2000.0
    strict = summarize_run([chat, long], SLOSet(default=SLO(ttft_ms=200.0)))
    assert strict["classes"]["long"]["num_good"] == 0
    assert strict["overall"]["num_good"] == 1


def test_max_itl_slo_counts_the_longest_stall():
    r = streamed([10.0, 10.0, 300.0, 10.0])
    assert not meets_slo(r, SLO(max_itl_ms=250.0))
    assert meets_slo(r, SLO(max_itl_ms=301.0))


def test_undefined_metrics_cannot_miss_and_summarize_to_none():
    one_token = streamed([])
    assert one_token.tpot_s is None and one_token.max_itl_s is None
    assert meets_slo(one_token, SLO(tpot_ms=1.0, max_itl_ms=1.0))
    empty = summarize([])
    assert empty["count"] == 0 and empty["p99"] is None
    report = summarize_run([one_token], SLOSet())
    assert report["overall"]["itl_ms"]["p50"] is None


def test_short_answers_are_counted():
    r = streamed([10.0] * 3)
    r.max_tokens = 8
    assert summarize_run([r], SLOSet())["overall"]["num_short"] == 1
