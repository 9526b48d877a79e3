"""Workloads, flags on top of them, the prompts they make, and the load generator's budget
(with a stand-in client, so no server runs)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import pytest

from pdserve.bench.cli import add_arguments
from pdserve.bench.loadgen import RunSettings, build_streams, run_point
from pdserve.bench.options import build_points, resolve_slos, resolve_workload
from pdserve.bench.prompts import ClassSampler, load_dataset
from pdserve.bench.stats import SLO, RequestResult
from pdserve.bench.workload import (
    Arrival,
    Distribution,
    WorkloadError,
    load_workload,
    mixed_workload,
    parse_distribution,
    parse_workload,
    workload_as_dict,
)


def flags(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_distributions_from_numbers_strings_and_mappings():
    rng = random.Random(0)
    assert parse_distribution(32, "x") == Distribution("fixed", 32.0)
    assert parse_distribution("32", "x").sample(rng) == 32
    uniform = parse_distribution("uniform:16:64", "x")
    assert all(16 <= uniform.sample(rng) <= 64 for _ in range(200))
    normal = parse_distribution({"dist": "normal", "mean": 100, "std": 300, "min": 10, "max": 150}, "x")
    samples = [normal.sample(rng) for _ in range(500)]
    assert min(samples) == 10 and max(samples) == 150
    lognormal = parse_distribution("lognormal:200:0.5", "x")
    median = sorted(lognormal.sample(rng) for _ in range(2001))[1000]
    assert 170 <= median <= 230


@pytest.mark.parametrize("raw, message", [
    ("gamma:1:2", "unknown distribution 'gamma'"),
    ({"dist": "weibull"}, "unknown distribution 'weibull'"),
    ("uniform:9:3", "1 <= min <= max"),
    ("normal:5", "takes 2 number"),
    (0, ">= 1"),
    ("abc", "cannot read 'abc'"),
    ({"dist": "fixed", "value": 3, "shape": 1}, "unknown field"),
])
def test_bad_distributions_say_what_is_wrong(raw, message):
    with pytest.raises(WorkloadError, match=message):
        parse_distribution(raw, "prompt_tokens")


def test_a_workload_file_round_trips(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("""
name: two
seed: 7
duration_s: 5
rate: 2
classes:
  - {name: chat, prompt_tokens: 32, output_tokens: "uniform:8:16", share: 3}
  - name: long
    prompt_tokens: {dist: lognormal, median: 1000, sigma: 0.3, max: 1800}
    output_tokens: 8
    concurrency: 1
    slo: {ttft_ms: 2000}
""")
    w = load_workload(path)
    assert w.seed == 7 and w.duration_s == 5.0 and w.arrival == Arrival("poisson", rate=2.0)
    assert [c.name for c in w.classes] == ["chat", "long"]
    assert w.classes[1].arrival == Arrival("closed", concurrency=1)
    assert w.classes[1].slo == SLO(ttft_ms=2000.0)
    assert parse_workload(json.loads(json.dumps(workload_as_dict(w))), tmp_path) == w


@pytest.mark.parametrize("text, message", [
    ("classes: [", "not valid YAML"),
    ("classes: []", "non-empty list"),
    ("classes: [{name: a, output_tokens: 8}]", "exactly one of prompt_tokens or dataset"),
    ("classes: [{name: a, prompt_tokens: 8, output_tokens: 8, rate: 1, concurrency: 2}]", "not both"),
    ("classes: [{name: a, prompt_tokens: 8, output_tokens: 8, colour: red}]", "unknown field"),
    ("bogus: 1\nclasses: [{name: a, prompt_tokens: 8, output_tokens: 8}]", "unknown workload field"),
])
def test_bad_workload_files_are_workload_errors(tmp_path, text, message):
    path = tmp_path / "w.yaml"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=message):
        load_workload(path)


def test_flags_build_or_override_the_workload():
    w = resolve_workload(flags("--prompt-tokens", "16", "--output-tokens", "8", "--num-requests", "5"))
    assert [c.name for c in w.classes] == ["default"]
    assert w.num_requests == 5 and w.duration_s is None
    mixed = resolve_workload(flags())
    assert mixed == mixed_workload()
    shorter = resolve_workload(flags("--workload", "mixed", "--output-tokens", "4", "--duration", "3"))
    assert [c.output_tokens for c in shorter.classes] == [Distribution("fixed", 4.0)] * 2
    assert [c.arrival for c in shorter.classes] == [c.arrival for c in mixed.classes]
    assert shorter.duration_s == 3.0


def test_slo_flags_the_most_specific_wins(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("slo: {ttft_ms: 100, tpot_ms: 40}\nconcurrency: 1\nclasses:\n"
                    "  - {name: chat, prompt_tokens: 8, output_tokens: 8}\n"
                    "  - {name: long, prompt_tokens: 8, output_tokens: 8, slo: {ttft_ms: 3000}}\n")
    args = flags("--workload", str(path), "--slo-ttft-ms", "200", "--slo-tpot-ms", "long=80")
    slos = resolve_slos(args, resolve_workload(args))
    assert slos.for_class("chat") == SLO(ttft_ms=200.0, tpot_ms=40.0)
    assert slos.for_class("long") == SLO(ttft_ms=3000.0, tpot_ms=80.0)
    with pytest.raises(WorkloadError, match="unknown class"):
        resolve_slos(flags("--slo-ttft-ms", "nope=3"), mixed_workload())


def test_rate_flags_make_points():
    assert [p.rate for p in build_points(flags("--rates", "0.5,1,2"), mixed_workload())] == [0.5, 1, 2]
    (only,) = build_points(flags(), mixed_workload())
    assert only.arrival is None and "concurrency 8" in only.label
    with pytest.raises(WorkloadError):
        build_points(flags("--rates", "1,-2"), mixed_workload())


def test_prompts_are_seeded_per_class_and_in_vocab():
    chat = mixed_workload().classes[0]
    a = [ClassSampler(chat, 0, "ids", 256).next() for _ in range(1)][0]
    b = ClassSampler(chat, 0, "ids", 256).next()
    assert a == b and len(a.prompt) == 32 and all(0 <= t < 256 for t in a.prompt)
    assert ClassSampler(chat, 1, "ids", 256).next() != a
    text = ClassSampler(chat, 0, "text", 256).next()
    assert isinstance(text.prompt, str) and len(text.prompt.split()) == 32


def test_datasets_sharegpt_and_prompt_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "x" * 40}]},
            {"conversations": [{"from": "gpt", "value": "no human turn: skipped"}]},
            {"prompt": [1, 2, 3], "max_tokens": 5}, {"prompt": "hello", "max_tokens": 2}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = load_dataset(path)
    assert [(r.prompt, r.max_tokens) for r in got] == [("hi there", 10), ([1, 2, 3], 5), ("hello", 2)]
    path.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    with pytest.raises(WorkloadError, match=r"d.jsonl:2"):
        load_dataset(path)


class StandInClient:
    """Answers every request after ``delay_s`` with one token per ``max_tokens``."""

    def __init__(self, delay_s: float = 0.01) -> None:
        self.delay_s = delay_s
        self.in_flight = self.max_in_flight = 0
        self.sent: list[str] = []

    async def complete(self, req) -> RequestResult:
        start = time.perf_counter()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.sent.append(req.class_name)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        now = time.perf_counter()
        return RequestResult(req.class_name, req.max_tokens, start, now, chunk_times_s=[now],
                             chunk_tokens=[req.max_tokens])


def test_closed_loop_run_sends_exactly_the_budget():
    client = StandInClient()
    settings = RunSettings(num_requests=12, num_warmup=2, show_progress=False)
    w = resolve_workload(flags("--prompt-tokens", "4", "--output-tokens", "2"))
    results = asyncio.run(run_point(client, w, Arrival("closed", concurrency=3), settings, "t"))
    assert len(results) == 12 and len(client.sent) == 14  # warm-up requests are not results
    assert client.max_in_flight == 3


def test_per_class_streams_run_side_by_side_until_the_duration():
    client = StandInClient(delay_s=0.05)
    w = mixed_workload()
    settings = RunSettings(duration_s=0.5, num_warmup=0, show_progress=False)
    assert [s.label for s in build_streams(w, None, settings)] == ["chat", "long"]
    results = asyncio.run(run_point(client, w, None, settings, "t"))
    by_class = {name: sum(r.class_name == name for r in results) for name in ("chat", "long")}
    assert by_class["long"] == 1  # periodic every 3 s: only the one at t=0
    assert by_class["chat"] >= 8 and client.max_in_flight <= 9


def test_each_point_of_a_sweep_draws_other_prompts():
    # One deployment serves every point: prompts repeated across points would be
    # prefix-cache hits and make later points look faster than they are.
    from pdserve.bench.cli import point_workloads

    workloads = point_workloads(mixed_workload(), 3)
    firsts = [ClassSampler(w.classes[0], w.seed, "ids", 256).next() for w in workloads]
    assert len({str(f) for f in firsts}) == 3
    assert point_workloads(mixed_workload(), 3) == workloads  # rounds repeat them
