"""Pure builders of a cluster's control plane: the Controller and Coordinator Deployments.

Owns their containers, probes and rollout strategy; the Coordinator's arguments
come from ``pdserve.api.component_args.coordinator_argv``, which ``pdserve up``
uses too, so local mode and Kubernetes run the same settings.

Invariants: the Controller Service routes to the elected leader only (readiness is
``/leaderz``), so agents and Coordinators need one address; the Controller rolls
with ``Recreate`` (a standby is never Ready, a rolling update would wait forever);
both pod templates carry the config hash, so a spec change restarts them with the
new cluster file.
"""

from __future__ import annotations

from pdserve.api import PDCluster
from pdserve.api.component_args import coordinator_argv
from pdserve.operator import builders as b
from pdserve.operator.settings import OperatorSettings


def _deployment(cluster: PDCluster, name: str, component: str, replicas: int, container: dict,
                settings: OperatorSettings, strategy: str) -> dict:
    container = {"image": cluster.spec.image or settings.image, **container,
                 "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                 "volumeMounts": [{"name": "config", "mountPath": b.CONFIG_DIR, "readOnly": True}]}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": b.metadata(cluster, name, component),
        "spec": {
            "replicas": replicas,
            "strategy": {"type": strategy},
            "selector": {"matchLabels": b.selector(cluster, component)},
            "template": {
                "metadata": {"labels": b.labels(cluster, component),
                             "annotations": {b.CONFIG_HASH_ANNOTATION: b.config_hash(cluster)}},
                "spec": {
                    "serviceAccountName": b.controlplane_account_name(cluster),
                    "containers": [container],
                    "volumes": [{"name": "config",
                                 "configMap": {"name": b.config_map_name(cluster)}}],
                },
            },
        },
    }


def _http_probe(path: str, port: str, period_s: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period_s}


def build_controller_deployment(cluster: PDCluster, settings: OperatorSettings) -> dict:
    component = cluster.spec.controller
    # Two Controllers on two memory stores would both lead: without etcd, run one.
    replicas = component.replicas if settings.etcd_endpoints else min(component.replicas, 1)
    container = {
        "name": "controller",
        "args": ["controller", "-f", b.CONFIG_FILE, "--store", settings.store_url,
                 "--host", "0.0.0.0", "--port", str(b.CONTROLLER_GRPC_PORT),
                 "--http-port", str(b.CONTROLLER_HTTP_PORT),
                 "--advertise", f"$(POD_IP):{b.CONTROLLER_GRPC_PORT}"],
        "ports": [{"name": "grpc", "containerPort": b.CONTROLLER_GRPC_PORT},
                  {"name": "http", "containerPort": b.CONTROLLER_HTTP_PORT}],
        "livenessProbe": _http_probe("/healthz", "http", 10),
        "readinessProbe": _http_probe("/leaderz", "http", 2),
        "resources": component.resources.to_manifest(),
    }
    return _deployment(cluster, b.controller_service_name(cluster), "controller", replicas,
                       container, settings, "Recreate")


def build_coordinator_deployment(cluster: PDCluster, settings: OperatorSettings) -> dict:
    component = cluster.spec.coordinator
    container = {
        "name": "coordinator",
        "args": coordinator_argv(
            cluster, "0.0.0.0", b.COORDINATOR_PORT,
            f"{b.controller_service_name(cluster)}:{b.CONTROLLER_GRPC_PORT}"),
        "ports": [{"name": "http", "containerPort": b.COORDINATOR_PORT}],
        "livenessProbe": _http_probe("/health", "http", 10),
        "readinessProbe": _http_probe("/ready", "http", 5),
        "resources": component.resources.to_manifest(),
    }
    return _deployment(cluster, f"{cluster.metadata.name}-coordinator", "coordinator",
                       component.replicas, container, settings, "RollingUpdate")
