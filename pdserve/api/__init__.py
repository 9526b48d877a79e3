"""Schemas shared by every component: cluster specs and status, manifests, CRDs, wire
types, and the spec-to-arguments mapping. The bottom layer: it imports nothing else
from pdserve (what processes run at runtime lives in ``pdserve.runtime``)."""

from pdserve.api.cluster import PDCluster, PDClusterSpec, PDClusterStatus
from pdserve.api.conditions import Condition, get_condition, is_condition_true, set_condition
from pdserve.api.instance import PDInstance, PDInstanceSpec, PDInstanceStatus
from pdserve.api.manifest import (
    ManifestError,
    default_cluster,
    dump_manifest,
    load_manifest,
    parse_manifest,
)
from pdserve.api.pool import PDPool, PDPoolSpec, PDPoolStatus

__all__ = [
    "Condition",
    "ManifestError",
    "PDCluster",
    "PDClusterSpec",
    "PDClusterStatus",
    "PDInstance",
    "PDInstanceSpec",
    "PDInstanceStatus",
    "PDPool",
    "PDPoolSpec",
    "PDPoolStatus",
    "default_cluster",
    "dump_manifest",
    "get_condition",
    "is_condition_true",
    "load_manifest",
    "parse_manifest",
    "set_condition",
]
