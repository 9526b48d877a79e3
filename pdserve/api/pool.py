"""The ``PDPool`` resource: one pool of a PDCluster as an object with a ``scale``
subresource, so that a HorizontalPodAutoscaler, KEDA or ``kubectl scale`` can size one
pool. Kubernetes allows one scale subresource per kind and a PDCluster has three
pools, hence one small object per pool, named ``<cluster>-<pool>``
(``pdpool_name``), created by the operator and owned by the PDCluster.

Owns the spec (the cluster and pool it stands for, and ``replicas``) and the status
(engines, ready engines, the label selector of the pool's engine Pods, and the
cluster's replicas the operator last synced with). The scale subresource maps
``spec.replicas``, ``status.replicas`` and ``status.selector``
(``SCALE_SUBRESOURCE``).

Invariants: the PDCluster stays the source of truth; ``spec.replicas`` is a request
the operator writes into the PDCluster's ``spec.<pool>.replicas`` (or refuses, and
sets back) and otherwise mirrors (``pdserve.operator.pdpools`` owns the rule);
``spec.cluster`` and ``spec.pool`` never change (a CEL transition rule); only the
operator writes the status.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pdserve.api.cluster import MAX_CLUSTER_NAME
from pdserve.api.common import API_VERSION, ApiModel, ObjectMeta, StatusModel
from pdserve.api.instance import Pool


def _immutable(field: str) -> dict:
    # a transition rule: the apiserver checks it on updates only (there is no oldSelf
    # on create)
    return {"x-kubernetes-validations": [
        {"rule": "self == oldSelf", "message": f"spec.{field} is immutable"}]}


SCALE_SUBRESOURCE = {
    "specReplicasPath": ".spec.replicas",
    "statusReplicasPath": ".status.replicas",
    "labelSelectorPath": ".status.selector",
}
"""The CRD's ``subresources.scale``: what ``GET/PATCH .../pdpools/NAME/scale`` reads and writes."""


class PDPoolSpec(ApiModel):
    cluster: Annotated[str, Field(min_length=1, max_length=MAX_CLUSTER_NAME,
                                  json_schema_extra=_immutable("cluster"))]
    """Name of the PDCluster, same namespace; never changes."""
    pool: Annotated[Pool, Field(json_schema_extra=_immutable("pool"))]
    """The pool this object sizes: prefill, decode or hybrid; never changes."""
    replicas: int = Field(ge=0, le=1024)
    """Engines the pool is to run (the scale subresource's ``spec.replicas``). The
    operator writes a change into the PDCluster's ``spec.<pool>.replicas`` unless the
    SLO planner owns that field (``spec.planner`` enabled and not advisory, prefill and
    decode pools) or the PDCluster's rules refuse it; then it sets this back."""


class PDPoolStatus(StatusModel):
    replicas: int = Field(default=0, ge=0)
    """Engine Pods of the pool that exist and are not terminating (the scale
    subresource's ``status.replicas``, as a Deployment counts its Pods)."""
    ready_replicas: int = Field(default=0, ge=0)
    """Engines of the pool that serve (the PDCluster's ``status.ready<Pool>``)."""
    selector: str = ""
    """Label selector of the pool's engine Pods, e.g. ``pdserve.io/cluster=c,...``: what an
    autoscaler reads the Pods' metrics by."""
    observed_cluster_replicas: int | None = Field(default=None, ge=0)
    """The PDCluster's ``spec.<pool>.replicas`` when the operator last synced this pool; a
    ``spec.replicas`` that differs from it is a scale request."""


class PDPool(ApiModel):
    """One pool of a PDCluster, scalable (``kubectl scale pdpool/<cluster>-decode``; ``kubectl get pdp``)."""

    api_version: Literal["pdserve.io/v1alpha1"] = API_VERSION
    kind: Literal["PDPool"] = "PDPool"
    metadata: ObjectMeta
    spec: PDPoolSpec
    status: PDPoolStatus | None = None


def pdpool_name(cluster: str, pool: Pool) -> str:
    """The PDPool of ``pool``: ``<cluster>-<pool>``."""
    return f"{cluster}-{pool}"
