"""From ``pdserve bench`` flags to what a run needs: the workload, the SLO set, the points.

Owns the precedence between a workload file and flags:
  - no ``--workload``: the built-in ``mixed``, unless ``--dataset``,
    ``--prompt-tokens`` or ``--output-tokens`` is given: then one class ``default``
    built from those flags (closed loop, one stream, unless an arrival flag is given);
  - with ``--workload``: those flags replace the lengths (or the prompt source) of
    every class;
  - ``--rate``/``--concurrency``/``--rates`` replace every class's own arrival (one
    stream mixing the classes by share); ``--num-requests``/``--duration`` replace the
    workload's bounds (a run with no bound at all runs for ``DEFAULT_DURATION_S``);
  - SLO: the most specific threshold wins: ``--slo-* CLASS=MS``, then the class's
    ``slo`` in the file, then ``--slo-* MS``, then the file's top-level ``slo``.
Everything wrong raises ``WorkloadError`` (the CLI's exit code 2).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from .stats import SLO, SLOSet
from .workload import (
    Arrival,
    Distribution,
    RequestClass,
    Workload,
    WorkloadError,
    load_workload,
    mixed_workload,
    parse_distribution,
)

BUILTIN_WORKLOADS = {"mixed": mixed_workload}
DEFAULT_DURATION_S = 60.0
DEFAULT_TOKENS = 128
SLO_FLAGS = (("slo_ttft_ms", "ttft_ms"), ("slo_tpot_ms", "tpot_ms"), ("slo_max_itl_ms", "max_itl_ms"))


@dataclass(frozen=True)
class Point:
    """One measured run of a session: a sweep point, or the only run."""

    label: str
    rate: float | None
    arrival: Arrival | None
    """Replaces every class's arrival; None runs the workload's own arrivals."""


def _dist_flag(value: str | None, flag: str) -> Distribution | None:
    return None if value is None else parse_distribution(value, flag)


def resolve_workload(args: argparse.Namespace) -> Workload:
    prompt = _dist_flag(args.prompt_tokens, "--prompt-tokens")
    output = _dist_flag(args.output_tokens, "--output-tokens")
    dataset = Path(args.dataset) if args.dataset else None
    has_length_flags = prompt is not None or output is not None or dataset is not None
    if args.workload is None and has_length_flags:
        cls = RequestClass("default", prompt_tokens=None if dataset else (prompt or _fixed()),
                           output_tokens=output if (output or dataset) else _fixed(), dataset=dataset)
        workload = Workload("flags", (cls,), arrival=Arrival("closed", concurrency=1))
    else:
        name = args.workload or "mixed"
        workload = BUILTIN_WORKLOADS[name]() if name in BUILTIN_WORKLOADS else load_workload(Path(name))
        if has_length_flags:
            workload = replace(workload, classes=tuple(
                replace(c, prompt_tokens=None if dataset else (prompt or c.prompt_tokens),
                        dataset=dataset or (None if prompt else c.dataset),
                        output_tokens=output or c.output_tokens)
                for c in workload.classes))
    for c in workload.classes:
        if c.dataset is None and c.prompt_tokens is None:
            raise WorkloadError(f"class {c.name!r}: a dataset class given --prompt-tokens needs "
                                f"--output-tokens too")
    if args.seed is not None:
        workload = replace(workload, seed=args.seed)
    if args.num_requests is not None or args.duration is not None:
        workload = replace(workload, num_requests=args.num_requests, duration_s=args.duration)
    if workload.num_requests is None and workload.duration_s is None:
        workload = replace(workload, duration_s=DEFAULT_DURATION_S)
    return workload


def _fixed() -> Distribution:
    return Distribution("fixed", DEFAULT_TOKENS)


def parse_slo_flag(values: list[str] | None, flag: str) -> tuple[float | None, dict[str, float]]:
    """``["300", "long=2000"]`` -> (300.0, {"long": 2000.0}); the last one given wins."""
    default, per_class = None, {}
    for value in values or ():
        name, _, number = value.rpartition("=")
        try:
            ms = float(number)
        except ValueError:
            raise WorkloadError(f"{flag}: expected MS or CLASS=MS, got {value!r}") from None
        if ms <= 0:
            raise WorkloadError(f"{flag}: must be > 0, got {value!r}")
        if name:
            per_class[name] = ms
        else:
            default = ms
    return default, per_class


def resolve_slos(args: argparse.Namespace, workload: Workload) -> SLOSet:
    names = {c.name for c in workload.classes}
    flag_default: dict[str, float | None] = {}
    flag_class: dict[str, dict[str, float]] = {}
    for attr, field_name in SLO_FLAGS:
        flag = "--" + attr.replace("_", "-")
        default, per_class = parse_slo_flag(getattr(args, attr), flag)
        if unknown := set(per_class) - names:
            raise WorkloadError(f"{flag}: unknown class(es) {', '.join(sorted(unknown))}; "
                                f"the workload has {', '.join(sorted(names))}")
        flag_default[field_name] = default
        for name, ms in per_class.items():
            flag_class.setdefault(name, {})[field_name] = ms
    default = SLO(**flag_default).merged_over(workload.slo)
    per_class = {c.name: SLO(**flag_class.get(c.name, {})).merged_over(c.slo) for c in workload.classes}
    return SLOSet(default=default, per_class={k: v for k, v in per_class.items() if not v.is_empty()})


def build_points(args: argparse.Namespace, workload: Workload) -> list[Point]:
    if args.rates:
        try:
            rates = [float(r) for r in args.rates.split(",") if r.strip()]
        except ValueError:
            raise WorkloadError(f"--rates: expected numbers separated by commas, got {args.rates!r}") from None
        if not rates or any(r <= 0 for r in rates):
            raise WorkloadError(f"--rates: every rate must be > 0, got {args.rates!r}")
        return [Point(f"rate {r:g} req/s", r, Arrival(args.arrival, rate=r)) for r in rates]
    if args.rate is not None:
        if args.rate <= 0:
            raise WorkloadError(f"--rate: must be > 0, got {args.rate:g}")
        arrival = Arrival(args.arrival, rate=args.rate)
        return [Point(arrival.describe(), args.rate, arrival)]
    if args.concurrency is not None:
        if args.concurrency < 1:
            raise WorkloadError(f"--concurrency: must be >= 1, got {args.concurrency}")
        arrival = Arrival("closed", concurrency=args.concurrency)
        return [Point(arrival.describe(), None, arrival)]
    own = [f"{c.name}: {c.arrival.describe()}" for c in workload.classes if c.arrival is not None]
    if workload.arrival is not None and len(own) < len(workload.classes):
        own.append(f"others: {workload.arrival.describe()}")
    return [Point(f"{workload.name} ({'; '.join(own)})", None, None)]


def describe_slos(slos: SLOSet, class_names: list[str]) -> str:
    if slos.is_empty():
        return "none (goodput counts every successful request)"
    return "; ".join(f"{name}: {slos.for_class(name).describe()}" for name in class_names)
