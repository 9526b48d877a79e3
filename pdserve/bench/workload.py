"""What a benchmark sends: request classes, their length distributions and arrivals.

Owns the workload schema (a small YAML/JSON file or the built-in ``mixed``), its
validation, and the one place that reads it. Sampling concrete prompts lives in
``prompts``; timing them in ``loadgen``.

A workload is a list of classes. Each class has a prompt source (a synthetic length
distribution, or a JSONL dataset), an output-length distribution, an optional SLO,
a ``share`` and optionally its own arrival:
  - a class with its own ``concurrency`` (closed loop) or ``rate`` (req/s, Poisson or
    periodic) runs its own stream of requests;
  - the other classes share the workload's ``arrival``, each request drawing its class
    by ``share``.
So "8 closed-loop chat streams + one long prompt every 3 s" is two classes with own
arrivals. Run bounds (``num_requests`` total, ``duration_s``) end every stream.

Every problem raises ``WorkloadError`` whose message names the field.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import yaml

from .stats import SLO

PARAMS = {"fixed": ("value",), "uniform": ("min", "max"), "normal": ("mean", "std"),
          "lognormal": ("median", "sigma")}
"""Each distribution's parameters, in order (as a file names them)."""
DISTRIBUTIONS = tuple(PARAMS)
ARRIVALS = ("poisson", "periodic", "closed")
MAX_TOKENS_LIMIT = 1 << 20


class WorkloadError(ValueError):
    """A workload (file or flags) that cannot run; the message says which field and why."""


@dataclass(frozen=True)
class Distribution:
    """Token counts: fixed(a), uniform(a..b), normal(mean a, std b), lognormal(median a, sigma b).

    Samples are rounded and clamped to [low, high].
    """

    kind: str
    a: float
    b: float = 0.0
    low: int = 1
    high: int = MAX_TOKENS_LIMIT

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = self.a * math.exp(rng.gauss(0.0, self.b))
        return min(max(round(value), self.low), self.high)


@dataclass(frozen=True)
class Arrival:
    kind: str  # one of ARRIVALS
    rate: float = 0.0  # req/s, for poisson and periodic
    concurrency: int = 0  # for closed

    def describe(self) -> str:
        if self.kind == "closed":
            return f"concurrency {self.concurrency}"
        return f"{self.kind} {self.rate:.3g} req/s"


@dataclass(frozen=True)
class RequestClass:
    name: str
    prompt_tokens: Distribution | None = None
    output_tokens: Distribution | None = None
    """None only for a dataset class: each row's own length (or its reply's) is used."""
    dataset: Path | None = None
    share: float = 1.0
    arrival: Arrival | None = None
    slo: SLO = SLO()


@dataclass(frozen=True)
class Workload:
    name: str
    classes: tuple[RequestClass, ...]
    arrival: Arrival | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0
    slo: SLO = SLO()


def mixed_workload() -> Workload:
    """The built-in default: 8 closed-loop chat streams plus one long prompt every 3 s."""
    chat = RequestClass("chat", Distribution("fixed", 32), Distribution("fixed", 128),
                        share=0.9, arrival=Arrival("closed", concurrency=8))
    long = RequestClass("long", Distribution("fixed", 1800), Distribution("fixed", 8),
                        share=0.1, arrival=Arrival("periodic", rate=1 / 3))
    return Workload("mixed", (chat, long), duration_s=60.0)


def parse_distribution(raw, where: str) -> Distribution:
    """``32``, ``"uniform:16:64"``, or ``{dist: normal, mean: 200, std: 40, min: 1, max: 512}``.

    ``min``/``max`` clamp normal and lognormal samples (and are uniform's own bounds).
    """
    if isinstance(raw, bool) or raw is None:
        raise WorkloadError(f"{where}: expected a token count or a distribution, got {raw!r}")
    if isinstance(raw, int | float):
        return _build("fixed", [float(raw)], {}, where)
    if isinstance(raw, str):
        kind, *nums = [part.strip() for part in raw.split(":")]
        try:
            if not nums:
                return _build("fixed", [float(kind)], {}, where)
            values = [float(x) for x in nums]
        except ValueError:
            raise WorkloadError(f"{where}: cannot read {raw!r}; expected N or KIND:A[:B] "
                                f"with KIND one of {', '.join(DISTRIBUTIONS)}") from None
        return _build(kind, values, {}, where)
    if isinstance(raw, dict):
        raw = dict(raw)
        kind = str(raw.pop("dist", "fixed"))
        if kind not in PARAMS:
            return _build(kind, [], {}, where)  # raises: unknown distribution
        values = [_number(raw.pop(n, None), f"{where}.{n}") for n in PARAMS[kind]]
        bounds = {n: _number(raw.pop(n), f"{where}.{n}") for n in ("min", "max") if n in raw}
        if raw:
            raise WorkloadError(f"{where}: unknown field(s) {', '.join(sorted(raw))}")
        return _build(kind, values, bounds, where)
    raise WorkloadError(f"{where}: expected a token count or a distribution, got {raw!r}")


def _build(kind: str, values: list[float], bounds: dict, where: str) -> Distribution:
    if kind not in PARAMS:
        raise WorkloadError(f"{where}: unknown distribution {kind!r}; one of {', '.join(DISTRIBUTIONS)}")
    if len(values) != len(PARAMS[kind]):
        raise WorkloadError(f"{where}: {kind} takes {len(PARAMS[kind])} number(s) "
                            f"({', '.join(PARAMS[kind])}), got {len(values)}")
    a, b = values[0], (values[1] if len(values) > 1 else 0.0)
    if kind == "uniform":
        if not 1 <= a <= b:
            raise WorkloadError(f"{where}: uniform needs 1 <= min <= max, got {a:g}..{b:g}")
        return Distribution(kind, a, b, low=math.ceil(a), high=math.floor(b))
    if a < 1:
        raise WorkloadError(f"{where}: {kind} needs {PARAMS[kind][0]} >= 1, got {a:g}")
    if b < 0:
        raise WorkloadError(f"{where}: {kind} needs {PARAMS[kind][1]} >= 0, got {b:g}")
    low, high = int(bounds.get("min", 1)), int(bounds.get("max", MAX_TOKENS_LIMIT))
    if not 1 <= low <= high:
        raise WorkloadError(f"{where}: needs 1 <= min <= max, got {low}..{high}")
    return Distribution(kind, a, b, low=low, high=high)


def _number(raw, where: str, positive: bool = False) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise WorkloadError(f"{where}: expected a number, got {raw!r}")
    if positive and raw <= 0:
        raise WorkloadError(f"{where}: must be > 0, got {raw!r}")
    return float(raw)


def parse_slo(raw, where: str) -> SLO:
    if raw is None:
        return SLO()
    if not isinstance(raw, dict) or set(raw) - {"ttft_ms", "tpot_ms", "max_itl_ms"}:
        raise WorkloadError(f"{where}: expected a mapping of ttft_ms, tpot_ms, max_itl_ms")
    return SLO(*(None if raw.get(k) is None else _number(raw[k], f"{where}.{k}", positive=True)
                 for k in ("ttft_ms", "tpot_ms", "max_itl_ms")))


def parse_arrival(raw: dict, where: str) -> Arrival | None:
    """From ``concurrency: N`` or ``rate: R`` (+ ``arrival: poisson|periodic``) keys."""
    kind = raw.pop("arrival", None)
    rate, concurrency = raw.pop("rate", None), raw.pop("concurrency", None)
    if rate is not None and concurrency is not None:
        raise WorkloadError(f"{where}: give rate or concurrency, not both")
    if concurrency is not None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise WorkloadError(f"{where}.concurrency: expected an integer >= 1, got {concurrency!r}")
        return Arrival("closed", concurrency=concurrency)
    if rate is not None:
        kind = kind or "poisson"
        if kind not in ("poisson", "periodic"):
            raise WorkloadError(f"{where}.arrival: expected poisson or periodic, got {kind!r}")
        return Arrival(kind, rate=_number(rate, f"{where}.rate", positive=True))
    if kind is not None:
        raise WorkloadError(f"{where}.arrival: {kind!r} needs a rate")
    return None


def parse_workload(raw, base_dir: Path, name: str = "workload") -> Workload:
    """A workload from its file's parsed content; dataset paths are relative to ``base_dir``."""
    if not isinstance(raw, dict):
        raise WorkloadError("a workload must be a mapping with a 'classes' list")
    raw = dict(raw)
    classes_raw = raw.pop("classes", None)
    if not isinstance(classes_raw, list) or not classes_raw:
        raise WorkloadError("classes: expected a non-empty list")
    classes = tuple(_parse_class(c, i, base_dir) for i, c in enumerate(classes_raw))
    if len({c.name for c in classes}) != len(classes):
        raise WorkloadError("classes: names must be unique")
    num_requests = raw.pop("num_requests", None)
    if num_requests is not None and (not isinstance(num_requests, int) or num_requests < 1):
        raise WorkloadError(f"num_requests: expected an integer >= 1, got {num_requests!r}")
    duration = raw.pop("duration_s", None)
    seed = raw.pop("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise WorkloadError(f"seed: expected an integer, got {seed!r}")
    workload = Workload(
        name=str(raw.pop("name", name)), classes=classes, arrival=parse_arrival(raw, "workload"),
        num_requests=num_requests, seed=seed, slo=parse_slo(raw.pop("slo", None), "slo"),
        duration_s=None if duration is None else _number(duration, "duration_s", positive=True))
    if raw:
        raise WorkloadError(f"unknown workload field(s): {', '.join(sorted(raw))}")
    return workload


def _parse_class(raw, index: int, base_dir: Path) -> RequestClass:
    where = f"classes[{index}]"
    if not isinstance(raw, dict):
        raise WorkloadError(f"{where}: expected a mapping")
    raw = dict(raw)
    name = str(raw.pop("name", f"class{index}"))
    where = f"class {name!r}"
    dataset = raw.pop("dataset", None)
    prompt = raw.pop("prompt_tokens", None)
    output = raw.pop("output_tokens", None)
    if (dataset is None) == (prompt is None):
        raise WorkloadError(f"{where}: give exactly one of prompt_tokens or dataset")
    if dataset is None and output is None:
        raise WorkloadError(f"{where}: output_tokens is required")
    share = _number(raw.pop("share", 1.0), f"{where}.share", positive=True)
    cls = RequestClass(
        name=name, share=share,
        prompt_tokens=None if prompt is None else parse_distribution(prompt, f"{where}.prompt_tokens"),
        output_tokens=None if output is None else parse_distribution(output, f"{where}.output_tokens"),
        dataset=None if dataset is None else (base_dir / str(dataset)),
        arrival=parse_arrival(raw, where), slo=parse_slo(raw.pop("slo", None), f"{where}.slo"))
    if raw:
        raise WorkloadError(f"{where}: unknown field(s) {', '.join(sorted(raw))}")
    return cls


def load_workload(path: Path) -> Workload:
    """Called by the CLI for ``--workload PATH``: read, parse and validate a YAML/JSON file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise WorkloadError(f"cannot read workload {path}: {exc.strerror or exc}") from None
    try:
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise WorkloadError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                            f"{' '.join(line.strip() for line in str(exc).splitlines())}") from None
    try:
        return parse_workload(raw, path.parent, name=path.stem)
    except WorkloadError as exc:
        raise WorkloadError(f"{path}: {exc}") from None


def workload_as_dict(w: Workload) -> dict:
    """The resolved workload, in the file's own shape (for ``--json`` and ``--show-workload``)."""
    def arrival(a: Arrival | None) -> dict:
        if a is None:
            return {}
        return {"concurrency": a.concurrency} if a.kind == "closed" else {"rate": a.rate, "arrival": a.kind}

    def dist(d: Distribution | None):
        if d is None:
            return None
        plain = [int(x) if float(x).is_integer() else x for x in (d.a, d.b)]
        if d.kind == "fixed":
            return plain[0]
        named = dict(zip(PARAMS[d.kind], plain, strict=False))
        return {"dist": d.kind, **named} if d.kind == "uniform" else \
            {"dist": d.kind, **named, "min": d.low, "max": d.high}

    classes = [{"name": c.name, "share": c.share, **arrival(c.arrival),
                **({"dataset": str(c.dataset)} if c.dataset else {"prompt_tokens": dist(c.prompt_tokens)}),
                "output_tokens": dist(c.output_tokens),
                **({"slo": c.slo.as_dict()} if not c.slo.is_empty() else {})} for c in w.classes]
    return {"name": w.name, "seed": w.seed, "num_requests": w.num_requests, "duration_s": w.duration_s,
            **arrival(w.arrival), **({"slo": w.slo.as_dict()} if not w.slo.is_empty() else {}),
            "classes": classes}
