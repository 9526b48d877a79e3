"""Status conditions: the model and the one pure helper that sets them.

Owns ``Condition`` (the fields of Kubernetes ``metav1.Condition``), ``Conditions``
(a status's list of them, as every status model declares it) and
``set_condition``. Invariants: a condition list holds at most one entry per type;
``lastTransitionTime`` moves only when ``status`` changes; helpers never mutate
their input (they return new lists), so reconcile code can compare old and new.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import Field

from pdserve.api.common import StatusModel

ConditionType = Literal["Ready", "Progressing", "Degraded", "HybridFallback", "Doctor", "Planner"]
ConditionStatus = Literal["True", "False", "Unknown"]
CONDITION_TYPES: tuple[str, ...] = ("Ready", "Progressing", "Degraded", "HybridFallback", "Doctor",
                                    "Planner")

# metav1.Condition's reason syntax: CamelCase, no spaces.
REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class Condition(StatusModel):
    """One observation about the object, as in ``metav1.Condition``."""

    type: ConditionType
    """Ready, Progressing, Degraded, HybridFallback, Doctor or Planner."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: str = Field(min_length=1, max_length=1024, pattern=REASON_PATTERN)
    """CamelCase machine-readable cause, e.g. ``PoolsReady``."""
    message: str = Field(default="", max_length=32768)
    """Human-readable detail."""
    last_transition_time: datetime
    """When ``status`` last changed."""
    observed_generation: int | None = Field(default=None, ge=0)
    """``metadata.generation`` the condition was computed from."""


# A status's conditions, at most one per type: Kubernetes merges the list by ``type``.
Conditions = Annotated[list[Condition], Field(max_length=16, json_schema_extra={
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["type"],
})]


def get_condition(conditions: list[Condition], type: str) -> Condition | None:
    """The condition of ``type``, or ``None``."""
    return next((c for c in conditions if c.type == type), None)


def is_condition_true(conditions: list[Condition], type: str) -> bool:
    condition = get_condition(conditions, type)
    return condition is not None and condition.status == "True"


def set_condition(
    conditions: list[Condition],
    type: ConditionType,
    status: ConditionStatus,
    reason: str,
    message: str,
    observed_generation: int | None,
    now: datetime,
) -> list[Condition]:
    """A new list with the condition of ``type`` set; the input is left alone.

    Called by the operator's status writer on every reconcile. ``now`` is passed
    in (no clock read here) and kept to the second, as the apiserver does.
    ``lastTransitionTime`` keeps its old value unless ``status`` changed, so
    re-running reconcile with the same observation is a no-op on the list.
    """
    if now.tzinfo is None:
        raise ValueError("set_condition needs an aware datetime (UTC)")
    now = now.astimezone(UTC).replace(microsecond=0)
    old = get_condition(conditions, type)
    changed = old is None or old.status != status
    new = Condition(
        type=type,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=now if changed else old.last_transition_time,
        observed_generation=observed_generation,
    )
    if old is None:
        return [*conditions, new]
    return [new if c.type == type else c for c in conditions]
