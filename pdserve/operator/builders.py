"""Pure builders: the desired Kubernetes objects of a PDCluster, from its spec alone.

Owns names, labels, owner references, the cluster file, and the builders of the
cluster ConfigMap, the Services, the PodDisruptionBudgets, the token Secrets, the
PDInstances, and the volumes every component Pod shares (cluster token, TLS, model
weights). Engine Pods are in ``pods.py``, the Deployments in ``deployments.py``,
the whole list reconcile applies in ``desired.py``.

Invariants: every builder is a function of its arguments (no clock, no I/O, no
randomness: a token is an argument), so building twice gives equal dicts and
reconcile can compare them with what it observes; every object carries the cluster
label and an owner reference, so garbage collection removes it with its owner.
"""

from __future__ import annotations

import base64
import hashlib
import json

import yaml

from pdserve.api import PDCluster
from pdserve.api.common import API_VERSION
from pdserve.api.component_args import MODEL_DIR
from pdserve.api.instance import Pool, instance_name

GROUP_PREFIX = "pdserve.io"
CLUSTER_LABEL = f"{GROUP_PREFIX}/cluster"
COMPONENT_LABEL = f"{GROUP_PREFIX}/component"
POOL_LABEL = f"{GROUP_PREFIX}/pool"
INSTANCE_LABEL = f"{GROUP_PREFIX}/instance"
SPEC_HASH_LABEL = f"{GROUP_PREFIX}/spec-hash"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # on each EndpointSlice of a Service
CONFIG_HASH_ANNOTATION = f"{GROUP_PREFIX}/config-hash"
DRAIN_ANNOTATION = f"{GROUP_PREFIX}/drain-started-at"

CONFIG_DIR = "/etc/pdserve"
CONFIG_FILE = f"{CONFIG_DIR}/cluster.yaml"
TOKEN_DIR = "/etc/pdserve-token"
TOKEN_KEY = "token"
TLS_DIR = "/etc/pdserve-tls"
CONTROLLER_GRPC_PORT = 50050
CONTROLLER_HTTP_PORT = 8080
COORDINATOR_PORT = 8000
AGENT_HTTP_PORT = 8081
ENGINE_METRICS_PORT = 9400  # one engine per Pod: a fixed port Prometheus can find
KV_POOL_METRICS_PORT = 9003
POOLS: tuple[Pool, ...] = ("prefill", "decode", "hybrid")
PD_POOLS: tuple[Pool, ...] = ("prefill", "decode")


def spec_hash(data: object) -> str:
    """Ten hex digits of SHA-256 over ``data`` as canonical JSON."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]


def config_hash(cluster: PDCluster) -> str:
    """Hash of the whole spec: annotates the cluster ConfigMap (what ``kubectl`` sees)."""
    return spec_hash(cluster.spec.to_manifest())


def labels(cluster: PDCluster, component: str, **extra: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": cluster.metadata.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "pdserve",
        "app.kubernetes.io/managed-by": "pdserve-operator",
        CLUSTER_LABEL: cluster.metadata.name,
        COMPONENT_LABEL: component,
        **extra,
    }


def selector(cluster: PDCluster, component: str) -> dict[str, str]:
    return {CLUSTER_LABEL: cluster.metadata.name, COMPONENT_LABEL: component}


def pool_selector(cluster: PDCluster, pool: Pool) -> dict[str, str]:
    """The engine Pods of one pool."""
    return {**selector(cluster, "engine"), POOL_LABEL: pool}


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


def coordinator_service_name(cluster: PDCluster) -> str:
    """The user's entry: the Coordinator's REST endpoint."""
    return f"{cluster.metadata.name}-coordinator"


def controller_service_name(cluster: PDCluster) -> str:
    return f"{cluster.metadata.name}-controller"


def controller_address(cluster: PDCluster) -> str:
    """Where agents and Coordinators reach the leading Controller (its Service)."""
    return f"{controller_service_name(cluster)}:{CONTROLLER_GRPC_PORT}"


def kv_pool_service_name(cluster: PDCluster) -> str:
    return f"{cluster.metadata.name}-kv-pool"


def kv_pool_address(cluster: PDCluster) -> str:
    """Where engines join the cluster's shared KV pool (its master's Service)."""
    return f"{kv_pool_service_name(cluster)}:{cluster.spec.kv_pool.port}"


def engines_service_name(cluster: PDCluster) -> str:
    return f"{cluster.metadata.name}-engines"


def token_secret_name(cluster_name: str) -> str:
    return f"{cluster_name}-token"


def build_cluster_yaml(cluster: PDCluster, spec: dict | None = None) -> str:
    """A cluster file a component reads with ``-f``: the PDCluster with ``spec`` (the
    whole spec by default; an engine's view of it for engine Pods)."""
    doc = {"apiVersion": API_VERSION, "kind": "PDCluster",
           "metadata": {"name": cluster.metadata.name, "namespace": cluster.metadata.namespace},
           "spec": cluster.spec.to_manifest() if spec is None else spec}
    return yaml.safe_dump(doc, sort_keys=False)


def build_config_map(cluster: PDCluster) -> dict:
    """The whole spec as the Controller reads it (and ``kubectl get cm`` shows it)."""
    meta = metadata(cluster, config_map_name(cluster), "config")
    meta["annotations"] = {CONFIG_HASH_ANNOTATION: config_hash(cluster)}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "data": {"cluster.yaml": build_cluster_yaml(cluster)}}


def _service(cluster: PDCluster, name: str, component: str, ports: list[dict], **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(cluster, name, component),
            "spec": {"selector": selector(cluster, component), "ports": ports, **spec}}


def build_services(cluster: PDCluster) -> list[dict]:
    """Coordinator (the user's entry), Controller (leader only: readiness is /leaderz),
    a headless Service giving each engine Pod a DNS name, and the KV pool's master
    when the spec enables one."""
    pool = [_service(cluster, kv_pool_service_name(cluster), "kv-pool",
                     [{"name": "rpc", "port": cluster.spec.kv_pool.port, "targetPort": "rpc"},
                      {"name": "metrics", "port": KV_POOL_METRICS_PORT, "targetPort": "metrics"}])
            ] if cluster.spec.kv_pool.enabled else []
    return [*pool,
        _service(cluster, coordinator_service_name(cluster), "coordinator",
                 [{"name": "http", "port": COORDINATOR_PORT, "targetPort": "http"}]),
        _service(cluster, controller_service_name(cluster), "controller",
                 [{"name": "grpc", "port": CONTROLLER_GRPC_PORT, "targetPort": "grpc"},
                  {"name": "http", "port": CONTROLLER_HTTP_PORT, "targetPort": "http"}]),
        _service(cluster, engines_service_name(cluster), "engine",
                 [{"name": "http", "port": AGENT_HTTP_PORT, "targetPort": "http"},
                  {"name": "metrics", "port": ENGINE_METRICS_PORT, "targetPort": "metrics"}],
                 clusterIP="None", publishNotReadyAddresses=True),
    ]


def build_disruption_budgets(cluster: PDCluster) -> list[dict]:
    """One PodDisruptionBudget per pool with replicas: a node drain evicts at most one
    engine of a pool at a time (the operator's own rollout deletes, it never evicts,
    and keeps the same bound itself: ``rollout.py``)."""
    return [{"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
             "metadata": metadata(cluster, f"{cluster.metadata.name}-{pool}", "engine",
                                  **{POOL_LABEL: pool}),
             "spec": {"maxUnavailable": 1, "selector": {"matchLabels": pool_selector(cluster, pool)}}}
            for pool in POOLS if getattr(cluster.spec, pool).replicas > 0]


def _secret(meta: dict, data: dict[str, bytes]) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


def build_token_secret(cluster: PDCluster, token: str) -> dict:
    """The cluster token every component of ``cluster`` presents and checks."""
    return _secret(metadata(cluster, token_secret_name(cluster.metadata.name), "token"),
                   {TOKEN_KEY: token.encode()})


def build_key_secret(namespace: str, name: str, key: bytes) -> dict:
    """The operator's own key (cluster tokens are derived from it: ``tokens.py``)."""
    meta = {"name": name, "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/part-of": "pdserve",
                       "app.kubernetes.io/component": "operator-key"}}
    return _secret(meta, {"key": key})


def model_volume(cluster: PDCluster) -> dict | None:
    """The volume holding a pvc or image model (mounted read-only at ``MODEL_DIR``)."""
    model = cluster.spec.model
    if model.pvc is not None:
        return {"name": "model", "persistentVolumeClaim": {"claimName": model.pvc.claim_name,
                                                           "readOnly": True}}
    if model.image is not None:
        return {"name": "model", "image": {"reference": model.image, "pullPolicy": "IfNotPresent"}}
    return None


def shared_mounts(cluster: PDCluster, *, with_model: bool) -> tuple[list[dict], list[dict], list[dict]]:
    """(env, volumes, volumeMounts) every component container gets: the cluster token
    (``PDSERVE_CLUSTER_TOKEN_FILE``), the TLS files when ``spec.security.tlsSecret`` is
    set (``PDSERVE_TLS_*``, read by ``pdserve.runtime.security.SecuritySettings.from_env``),
    and, ``with_model``, the pvc or image model at ``MODEL_DIR``."""
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "PDSERVE_CLUSTER_TOKEN_FILE", "value": f"{TOKEN_DIR}/{TOKEN_KEY}"}]
    volumes = [{"name": "cluster-token",
                "secret": {"secretName": token_secret_name(cluster.metadata.name)}}]
    mounts = [{"name": "cluster-token", "mountPath": TOKEN_DIR, "readOnly": True}]
    tls = cluster.spec.security.tls_secret
    if tls:
        env += [{"name": f"PDSERVE_TLS_{var}", "value": f"{TLS_DIR}/{file}"}
                for var, file in (("CERT", "tls.crt"), ("KEY", "tls.key"), ("CA", "ca.crt"))]
        volumes.append({"name": "tls", "secret": {"secretName": tls}})
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    model = model_volume(cluster) if with_model else None
    if model is not None:
        volumes.append(model)
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    return env, volumes, mounts


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
