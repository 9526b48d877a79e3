"""Pure builders: the desired Kubernetes objects of a PDCluster, from its spec alone.

Owns names, labels, owner references, the engine-settings hash, and the builders
of the ConfigMap, Services, control-plane ServiceAccount/RoleBinding and
PDInstances (Pods and Deployments are in ``pods.py`` and ``deployments.py``).

Invariants: every builder is a function of its arguments (no clock, no I/O, no
randomness), so building twice gives equal dicts and reconcile can compare them
with what it observes; every object carries the cluster label and an owner
reference, so garbage collection removes it with its owner.
"""

from __future__ import annotations

import hashlib
import json

import yaml

from pdserve.api import PDCluster
from pdserve.api.common import API_VERSION
from pdserve.api.instance import Pool, instance_name

GROUP_PREFIX = "pdserve.io"
CLUSTER_LABEL = f"{GROUP_PREFIX}/cluster"
COMPONENT_LABEL = f"{GROUP_PREFIX}/component"
POOL_LABEL = f"{GROUP_PREFIX}/pool"
INSTANCE_LABEL = f"{GROUP_PREFIX}/instance"
SPEC_HASH_LABEL = f"{GROUP_PREFIX}/spec-hash"
CONFIG_HASH_ANNOTATION = f"{GROUP_PREFIX}/config-hash"
DRAIN_ANNOTATION = f"{GROUP_PREFIX}/drain-started-at"

CONFIG_DIR = "/etc/pdserve"
CONFIG_FILE = f"{CONFIG_DIR}/cluster.yaml"
CONTROLLER_GRPC_PORT = 50050
CONTROLLER_HTTP_PORT = 8080
COORDINATOR_PORT = 8000
AGENT_HTTP_PORT = 8081
ENGINE_METRICS_PORT = 9400  # one engine per Pod: a fixed port Prometheus can find
POOLS: tuple[Pool, ...] = ("prefill", "decode", "hybrid")
PD_POOLS: tuple[Pool, ...] = ("prefill", "decode")

# Spec fields that do not change what an engine computes or how it pairs: replica
# counts (scaling), core pinning (local mode only: ignored here) and the
# control-plane Deployments (rolled by their own hash).
_NOT_ENGINE_SETTINGS = (*((pool, field) for pool in POOLS for field in ("replicas", "cpuAffinity")),
                        ("coordinator",), ("controller",))


def _hash(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]


def engine_spec_hash(cluster: PDCluster) -> str:
    """Hash of the engine settings: Pods of two hashes must never serve as a P/D pair."""
    spec = cluster.spec.to_manifest()
    for path in _NOT_ENGINE_SETTINGS:
        parent = spec
        for key in path[:-1]:
            parent = parent.get(key, {})
        parent.pop(path[-1], None)
    return _hash(spec)


def config_hash(cluster: PDCluster) -> str:
    """Hash of the whole spec: the control-plane Deployments roll when it changes."""
    return _hash(cluster.spec.to_manifest())


def labels(cluster: PDCluster, component: str, **extra: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": cluster.metadata.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "pdserve-operator",
        CLUSTER_LABEL: cluster.metadata.name,
        COMPONENT_LABEL: component,
        **extra,
    }


def selector(cluster: PDCluster, component: str) -> dict[str, str]:
    return {CLUSTER_LABEL: cluster.metadata.name, COMPONENT_LABEL: component}


def owner_reference(api_version: str, kind: str, name: str, uid: str | None) -> dict:
    return {"apiVersion": api_version, "kind": kind, "name": name, "uid": uid or "",
            "controller": True, "blockOwnerDeletion": True}


def cluster_owner(cluster: PDCluster) -> dict:
    return owner_reference(API_VERSION, "PDCluster", cluster.metadata.name, cluster.metadata.uid)


def metadata(cluster: PDCluster, name: str, component: str, **extra_labels: str) -> dict:
    return {"name": name, "namespace": cluster.metadata.namespace,
            "labels": labels(cluster, component, **extra_labels),
            "ownerReferences": [cluster_owner(cluster)]}


def config_map_name(cluster: PDCluster) -> str:
    return f"{cluster.metadata.name}-config"


def controller_service_name(cluster: PDCluster) -> str:
    return f"{cluster.metadata.name}-controller"


def controlplane_account_name(cluster: PDCluster) -> str:
    return f"{cluster.metadata.name}-controlplane"


def build_cluster_yaml(cluster: PDCluster) -> str:
    """The cluster file every component reads with ``-f``: the PDCluster spec as YAML."""
    doc = {"apiVersion": API_VERSION, "kind": "PDCluster",
           "metadata": {"name": cluster.metadata.name, "namespace": cluster.metadata.namespace},
           "spec": cluster.spec.to_manifest()}
    return yaml.safe_dump(doc, sort_keys=False)


def build_config_map(cluster: PDCluster) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": metadata(cluster, config_map_name(cluster), "config"),
            "data": {"cluster.yaml": build_cluster_yaml(cluster)}}


def _service(cluster: PDCluster, name: str, component: str, ports: list[dict], **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(cluster, name, component),
            "spec": {"selector": selector(cluster, component), "ports": ports, **spec}}


def build_services(cluster: PDCluster) -> list[dict]:
    """Coordinator (the user's entry), Controller (leader only: readiness is /leaderz),
    and a headless Service giving each engine Pod a DNS name."""
    name = cluster.metadata.name
    return [
        _service(cluster, f"{name}-coordinator", "coordinator",
                 [{"name": "http", "port": COORDINATOR_PORT, "targetPort": "http"}]),
        _service(cluster, controller_service_name(cluster), "controller",
                 [{"name": "grpc", "port": CONTROLLER_GRPC_PORT, "targetPort": "grpc"},
                  {"name": "http", "port": CONTROLLER_HTTP_PORT, "targetPort": "http"}]),
        _service(cluster, f"{name}-engines", "engine",
                 [{"name": "http", "port": AGENT_HTTP_PORT, "targetPort": "http"},
                  {"name": "metrics", "port": ENGINE_METRICS_PORT, "targetPort": "metrics"}],
                 clusterIP="None", publishNotReadyAddresses=True),
    ]


def build_controlplane_rbac(cluster: PDCluster, clusterrole: str) -> list[dict]:
    """The Controller's and Coordinator's ServiceAccount, bound to the chart's role."""
    account = controlplane_account_name(cluster)
    objects = [{"apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": metadata(cluster, account, "controlplane")}]
    if clusterrole:
        objects.append({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": metadata(cluster, account, "controlplane"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": clusterrole},
            "subjects": [{"kind": "ServiceAccount", "name": account,
                          "namespace": cluster.metadata.namespace}]})
    return objects


def desired_instances(cluster: PDCluster) -> dict[str, tuple[Pool, int]]:
    """Instance name -> (pool, ordinal) for every pool replica the spec asks for."""
    return {instance_name(cluster.metadata.name, pool, i): (pool, i)
            for pool in POOLS for i in range(getattr(cluster.spec, pool).replicas)}


def build_instance(cluster: PDCluster, pool: Pool, ordinal: int) -> dict:
    name = instance_name(cluster.metadata.name, pool, ordinal)
    return {"apiVersion": API_VERSION, "kind": "PDInstance",
            "metadata": metadata(cluster, name, "engine", **{POOL_LABEL: pool}),
            "spec": {"role": pool, "cluster": cluster.metadata.name, "pool": pool,
                     "ordinal": ordinal}}
