"""The ``PDInstance`` resource: one engine of a PDCluster, owned by it.

Owns the spec (role, cluster, pool, ordinal) and status (phase, pod, endpoints,
health, last heartbeat). The operator creates one PDInstance per pool replica and
one Pod per PDInstance; the Controller may switch an engine's role at run time
(prefill <-> decode), which ``status.role`` shows; ``pool`` (and ``spec.role``)
record where the instance came from.

Invariants: ``(cluster, pool, ordinal)`` names one instance; only the operator
writes the status: phase and pod from the Pod, health, last heartbeat and role
from the Controller's view (``pdserve.operator.status.build_instance_status``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from pdserve.api.common import API_VERSION, ApiModel, ObjectMeta, StatusModel
from pdserve.api.conditions import Conditions

Role = Literal["prefill", "decode", "hybrid"]
Pool = Literal["prefill", "decode", "hybrid"]
Phase = Literal["Pending", "Running", "Terminating", "Failed"]
Health = Literal["Starting", "Ready", "Suspect", "Failed"]


class PDInstanceSpec(ApiModel):
    role: Role
    """The role the engine starts in (its pool's); ``status.role`` is the one it runs now."""
    cluster: str = Field(min_length=1)
    """Name of the owning PDCluster, same namespace."""
    pool: Pool
    """Pool that created the instance; its resources and parallelism apply."""
    ordinal: int = Field(ge=0)
    """Index within the pool; stable across restarts."""


class PDInstanceStatus(StatusModel):
    observed_generation: int | None = Field(default=None, ge=0)
    phase: Phase | None = None
    """Lifecycle of the Pod: Pending, Running, Terminating, Failed."""
    pod: str | None = None
    """Name of the Pod running the engine."""
    endpoints: dict[str, str] = Field(default_factory=dict)
    """Addresses by purpose, e.g. ``engine: 10.0.0.5:50051``, ``kv: 10.0.0.5:17000``."""
    health: Health | None = None
    """Starting, Ready, Suspect, Failed, as the operator reads them from the Controller."""
    last_heartbeat: datetime | None = None
    role: Role | None = None
    """Role the engine last reported (differs from spec.role during a switch)."""
    conditions: Conditions = Field(default_factory=list)


class PDInstance(ApiModel):
    """One engine of a PDCluster (``kubectl get pdi``)."""

    api_version: Literal["pdserve.io/v1alpha1"] = API_VERSION
    kind: Literal["PDInstance"] = "PDInstance"
    metadata: ObjectMeta
    spec: PDInstanceSpec
    status: PDInstanceStatus | None = None


def instance_name(cluster: str, pool: Pool, ordinal: int) -> str:
    """The PDInstance (and Pod) name for a pool replica: ``<cluster>-<pool>-<ordinal>``."""
    return f"{cluster}-{pool}-{ordinal}"


def instance_ordinal(cluster: str, pool: Pool, name: str) -> int | None:
    """The ordinal in ``name`` if it is ``instance_name(cluster, pool, n)``, else None."""
    prefix = f"{cluster}-{pool}-"
    rest = name[len(prefix):] if name.startswith(prefix) else ""
    return int(rest) if rest.isdigit() and str(int(rest)) == rest else None
