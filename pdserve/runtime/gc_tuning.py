"""The garbage collector of pdserve's serving processes (the Coordinator, the engine):
tuned once they have started, and every collection's pause measured.

A collection stops every thread of its process for as long as it runs: the
Coordinator's event loop with every request on it, the engine's session server and
its step. Python's defaults suit a short script, not a server that holds a large heap
and allocates thousands of short-lived objects per second:

- ``tune`` (once start-up is done: the Coordinator once its app is built, the engine
  once its model is loaded, a tensor-parallel rank once its shard and cache are)
  freezes what start-up built (modules, the model, the app) out of every later
  collection, so that a collection of the oldest generation, which walks everything
  not frozen, stays short; and it collects the youngest generation
  after 20,000 allocations instead of 700, so that a request's objects are mostly
  freed by their reference counts before a collection looks at them. The older
  generations keep their ratios. Measured: docs/benchmarks.md, Coordinator overhead.
- ``register_pauses(registry, component)`` puts
  ``pdserve_<component>_gc_pause_seconds{generation}``, every collection's duration,
  on a component's /metrics. A latency tail that lines up with pauses is the
  collector's.
"""

from __future__ import annotations

import gc
import time

from prometheus_client import CollectorRegistry

from pdserve.runtime.loop_histogram import LoopHistogram

YOUNG_THRESHOLD = 20_000
PAUSE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                 0.25, 0.5, 1.0)
GENERATIONS = ("0", "1", "2")

# One per process: the collector's callback observes it (collections never overlap, so
# one writer at a time, whichever thread triggered the collection); each registry renders
# it under its component's name.
PAUSES = LoopHistogram("gc_pause_seconds", "Garbage-collector pauses of this process "
                       "(every thread stops), by the generation collected.",
                       PAUSE_BUCKETS, None, labelnames=("generation",),
                       series=[(g,) for g in GENERATIONS])


def tune() -> None:
    """Called once, when the process has started (the module's docstring)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)


class _PauseTimer:
    """The ``gc.callbacks`` entry that times each collection into ``PAUSES``."""

    def __init__(self) -> None:
        self._series = [PAUSES.labels(g) for g in GENERATIONS]
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._series[info["generation"]].observe(time.perf_counter() - self._started)


_timer = _PauseTimer()


def register_pauses(registry: CollectorRegistry, component: str) -> None:
    """``PAUSES`` on ``registry`` as ``pdserve_<component>_gc_pause_seconds``; the
    process's collections are timed from now on."""
    if _timer not in gc.callbacks:
        gc.callbacks.append(_timer)
    PAUSES.renamed(f"pdserve_{component}_{PAUSES.name}", registry)
