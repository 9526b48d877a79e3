"""set_condition: one entry per type, transition time moves only on status change."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from pdserve.api import Condition, get_condition, is_condition_true, set_condition

T0 = datetime(2025, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)


def test_condition_lifecycle_ready_false_then_true_then_refreshed():
    empty: list[Condition] = []
    step1 = set_condition(empty, "Ready", "False", "PoolsStarting", "0/2 ready", 1, T0)
    assert empty == []  # the input list is left alone
    ready = get_condition(step1, "Ready")
    assert ready.last_transition_time == T0.replace(microsecond=0)
    assert not is_condition_true(step1, "Ready")

    step2 = set_condition(step1, "Ready", "True", "PoolsReady", "2/2 ready", 2, T1)
    assert get_condition(step2, "Ready").last_transition_time == T1.replace(microsecond=0)
    assert get_condition(step1, "Ready").status == "False"  # old list unchanged
    assert is_condition_true(step2, "Ready")

    later = T1 + timedelta(hours=1)
    step3 = set_condition(step2, "Ready", "True", "PoolsReady", "still ready", 3, later)
    refreshed = get_condition(step3, "Ready")
    assert refreshed.last_transition_time == T1.replace(microsecond=0)
    assert (refreshed.message, refreshed.observed_generation) == ("still ready", 3)
    assert len(step3) == 1


def test_types_are_kept_apart_and_in_order():
    conditions = set_condition([], "Ready", "True", "PoolsReady", "", 1, T0)
    conditions = set_condition(conditions, "HybridFallback", "False", "BothPoolsReady", "", 1, T0)
    conditions = set_condition(conditions, "Ready", "False", "DecodeLost", "", 2, T1)
    assert [c.type for c in conditions] == ["Ready", "HybridFallback"]
    assert get_condition(conditions, "Degraded") is None


def test_serialises_as_kubernetes_condition():
    [condition] = set_condition([], "Degraded", "True", "InstanceFailed", "p-0 failed", 4, T0)
    assert condition.to_manifest() == {
        "type": "Degraded", "status": "True", "reason": "InstanceFailed",
        "message": "p-0 failed", "lastTransitionTime": "2025-01-01T12:00:00Z",
        "observedGeneration": 4,
    }


def test_rejects_naive_time_and_bad_reason():
    with pytest.raises(ValueError):
        set_condition([], "Ready", "True", "PoolsReady", "", 1, datetime(2025, 1, 1))
    with pytest.raises(ValueError):
        set_condition([], "Ready", "True", "has spaces", "", 1, T0)
