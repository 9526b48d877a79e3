"""Everything the operator keeps for a PDCluster, as the lists reconcile applies.

Owns the composition of the builders (``builders``, ``pods``, ``deployments``):
``build_static_objects`` is exactly what ``Reconciler._apply_static`` applies on every
pass (create, or merge-patch where it differs), and ``static_kinds`` the kinds it
prunes by label; the token Secret (create-only), PDPools, PDInstances and engine Pods
follow their own rules in ``reconcile.py``. Tests and the chart checks build the same lists
from here rather than mirroring them.

Invariants: pure; an object whose pool has no replicas is not in the list (reconcile
deletes it: a pool scaled to zero keeps no PodDisruptionBudget and no engine config).
"""

from __future__ import annotations

from pdserve.api import PDCluster
from pdserve.operator import builders as b
from pdserve.operator.deployments import (
    build_controller_deployment,
    build_coordinator_deployment,
    build_kv_pool_deployment,
)
from pdserve.operator.pdpools import build_pdpools
from pdserve.operator.pods import build_engine_config_map, build_engine_pod, engine_pod_hash
from pdserve.operator.settings import OperatorSettings

PRUNED = (("ConfigMap", "engine-config"), ("PodDisruptionBudget", "engine"),
          ("Deployment", "kv-pool"), ("Service", "kv-pool"))
"""(kind, component label) of static objects that go when no longer built."""


def configured_pools(cluster: PDCluster) -> list[str]:
    return [p for p in b.POOLS if getattr(cluster.spec, p).replicas > 0]


def build_static_objects(cluster: PDCluster, settings: OperatorSettings) -> list[dict]:
    """The cluster file, each configured pool's engine file, the Services, the Controller
    and Coordinator Deployments and the pools' PodDisruptionBudgets, in apply order."""
    return [b.build_config_map(cluster),
            *(build_engine_config_map(cluster, pool) for pool in configured_pools(cluster)),
            *b.build_services(cluster),
            build_controller_deployment(cluster, settings),
            build_coordinator_deployment(cluster, settings),
            *([build_kv_pool_deployment(cluster, settings)] if cluster.spec.kv_pool.enabled else []),
            *b.build_disruption_budgets(cluster)]


def engine_pod_hashes(cluster: PDCluster, settings: OperatorSettings) -> dict[str, str]:
    """Pool -> the settings hash its engine Pods must carry now."""
    return {pool: engine_pod_hash(cluster, pool, settings) for pool in b.POOLS}


def build_cluster_objects(cluster: PDCluster, settings: OperatorSettings, token: str,
                          instance_uids: dict[str, str]) -> list[dict]:
    """Every object of a settled cluster: the static ones, the token Secret, the PDPools,
    and one PDInstance and one engine Pod per desired instance (``instance_uids``: name
    -> the PDInstance's uid, the Pod's owner). What the chart tests validate and check
    RBAC on."""
    desired = b.desired_instances(cluster)
    return [*build_static_objects(cluster, settings),
            b.build_token_secret(cluster, token),
            *build_pdpools(cluster),
            *(b.build_instance(cluster, pool, ordinal) for pool, ordinal in desired.values()),
            *(build_engine_pod(cluster, name, pool, instance_uids.get(name), settings)
              for name, (pool, _) in desired.items())]
