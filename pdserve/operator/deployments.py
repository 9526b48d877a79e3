"""Pure builders of a cluster's control plane: the Controller and Coordinator Deployments.

Owns their arguments (derived from the spec, so local mode and Kubernetes run the
same settings), probes and rollout strategy.

Invariants: the Controller Service routes to the elected leader only (readiness is
``/leaderz``), so agents and Coordinators need one address; the Controller rolls
with ``Recreate`` (a standby is never Ready, a rolling update would wait forever);
both pod templates carry the config hash, so a spec change restarts them with the
new cluster file.
"""

from __future__ import annotations

from pdserve.api import PDCluster
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


def coordinator_args(cluster: PDCluster) -> list[str]:
    spec = cluster.spec
    model = spec.model.preset or spec.model.path or "/models/" + (
        spec.model.pvc.sub_path if spec.model.pvc else "")
    args = ["coordinator", "--host", "0.0.0.0", "--port", str(b.COORDINATOR_PORT),
            "--controller", f"{b.controller_service_name(cluster)}:{b.CONTROLLER_GRPC_PORT}",
            "--model", model,
            "--served-model-name", spec.model.served_name or cluster.metadata.name,
            "--prefill-policy", spec.routing.prefill_policy,
            "--decode-policy", spec.routing.decode_policy,
            "--kv-mode", spec.kv_transfer.mode,
            "--local-prefill-max-tokens", str(spec.routing.local_prefill_max_tokens),
            "--fallback-policy", spec.fallback.policy,
            "--block-size", str(spec.engine.block_size)]
    if spec.slo.ttft_ms:
        args += ["--ttft-slo-s", f"{spec.slo.ttft_ms / 1000:g}"]
    return args


def build_coordinator_deployment(cluster: PDCluster, settings: OperatorSettings) -> dict:
    component = cluster.spec.coordinator
    container = {
        "name": "coordinator",
        "args": coordinator_args(cluster),
        "ports": [{"name": "http", "containerPort": b.COORDINATOR_PORT}],
        "livenessProbe": _http_probe("/health", "http", 10),
        "readinessProbe": _http_probe("/ready", "http", 5),
        "resources": component.resources.to_manifest(),
    }
    return _deployment(cluster, f"{cluster.metadata.name}-coordinator", "coordinator",
                       component.replicas, container, settings, "RollingUpdate")
