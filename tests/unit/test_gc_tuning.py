"""The collector of the serving processes: ``tune`` freezes start-up's objects and raises
the youngest generation's threshold; ``register_pauses`` renders every collection's
duration under the component's name, in as many registries as ask for it."""

from __future__ import annotations

import gc
import re

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.runtime import gc_tuning


@pytest.fixture
def collector_state():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_tune_freezes_what_exists_and_raises_the_youngest_threshold(collector_state):
    _, older, oldest = gc.get_threshold()
    made_at_start_up = [[i] for i in range(1000)]  # tracked containers
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    gc_tuning.tune()
    assert gc.get_freeze_count() >= len(made_at_start_up)
    assert gc.get_threshold() == (gc_tuning.YOUNG_THRESHOLD, older, oldest)
    # Frozen objects are out of every collection: a full one no longer walks them.
    assert not any(obj is made_at_start_up for obj in gc.get_objects())


def _counts(registry: CollectorRegistry, name: str) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {g: float(v) for g, v in re.findall(rf'^{name}_count{{generation="(\d)"}} (\S+)$', text, re.M)}


def test_each_collection_is_timed_into_every_registry_under_its_components_name():
    coordinator, engine = CollectorRegistry(), CollectorRegistry()
    gc_tuning.register_pauses(coordinator, "coordinator")
    gc_tuning.register_pauses(engine, "engine")
    assert gc.callbacks.count(gc_tuning._timer) == 1  # one timer however many registries

    before = _counts(coordinator, "pdserve_coordinator_gc_pause_seconds")
    assert set(before) == {"0", "1", "2"}
    gc.collect(1)
    gc.collect(2)
    gc.collect(2)
    after = _counts(coordinator, "pdserve_coordinator_gc_pause_seconds")
    assert after["1"] >= before["1"] + 1
    assert after["2"] >= before["2"] + 2
    assert _counts(engine, "pdserve_engine_gc_pause_seconds") == after  # one process, one series

    text = generate_latest(engine).decode()
    total = float(re.search(r'^pdserve_engine_gc_pause_seconds_sum{generation="2"} (\S+)$', text, re.M)[1])
    assert 0 < total < 60
    assert 'pdserve_engine_gc_pause_seconds_bucket{generation="2",le="+Inf"}' in text
    assert "pdserve_coordinator_gc_pause_seconds" not in text
