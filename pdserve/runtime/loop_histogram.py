"""A Prometheus histogram observed without locks, for metrics observed from one
thread at a time (the event loop's per-request histograms, the collector's pauses).

``LoopHistogram`` renders as prometheus_client's ``Histogram`` (``_bucket`` with
``le``, ``_count``, ``_sum``; no ``_created``); ``observe`` is a bisection and two
additions instead of prometheus_client's two locked increments."""

from __future__ import annotations

import bisect
import copy
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class LoopHistogram:
    """A histogram observed from one thread at a time (the module's docstring), so
    without locks. Without ``labelnames`` it is one series, observed through
    ``observe``; with them, one series per value tuple of ``series`` (a fixed set,
    rendered from zero in that order), observed through ``labels(*values).observe``.
    ``registry``: where it is registered (None: by its owner, through ``renamed``, in
    as many registries as render it)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry | None, labelnames: tuple[str, ...] = (),
                 series: Iterable[tuple[str, ...]] = ((),)) -> None:
        self.name = name
        self.documentation = documentation
        self._labelnames = labelnames
        bounds = [*buckets, float("inf")]
        self._series = {values: LoopSeries(bounds) for values in series}
        if not labelnames:
            self.observe = self._series[()].observe
        if registry is not None:
            registry.register(self)

    def renamed(self, name: str, registry: CollectorRegistry) -> LoopHistogram:
        """The same series, rendered as ``name`` in ``registry``."""
        twin = copy.copy(self)
        twin.name = name
        registry.register(twin)
        return twin

    def labels(self, *values: str) -> LoopSeries:
        return self._series[values]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self._labelnames)
        for values, series in self._series.items():
            family.add_metric(list(values), series.cumulative(), series.sum)
        yield family


class LoopSeries:
    """One series of a ``LoopHistogram``: counts per bucket (not cumulative) and the sum."""

    __slots__ = ("_bounds", "_counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds
        self._counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, amount)] += 1
        self.sum += amount

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, count in zip(self._bounds, self._counts, strict=True):
            total += count
            out.append((floatToGoString(bound), total))
        return out
