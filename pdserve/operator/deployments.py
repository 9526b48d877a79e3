"""Pure builders of a cluster's control plane: the Controller and Coordinator Deployments.

Owns their containers, probes, volumes and rollout strategy. The Coordinator's
arguments come from ``pdserve.api.component_args.coordinator_argv``, which ``pdserve
up`` uses too, so local mode and Kubernetes run the same settings; it reads no
cluster file, and mounts the model (its tokenizer) read-only where ``--model`` points.
The Controller reads the cluster file (``-f``): its pod template carries the hash of
``controller_settings``, the part of the spec it uses. Both run the control-plane
image (no torch); the KV pool's master runs the engine image.

Invariants: each pod template holds exactly what its component consumes, so a
Deployment rolls when, and only when, its component's settings change (replica
counts are the Deployment's, not the template's); the Controller Service routes to
the elected leader only (readiness is ``/leaderz``), so agents and Coordinators need
one address; the Controller rolls with ``Recreate`` (a standby is never Ready, a
rolling update would wait forever); no control-plane Pod gets a Kubernetes API
token (neither component calls the API).
"""

from __future__ import annotations

from pdserve.api import PDCluster
from pdserve.api.component_args import coordinator_argv
from pdserve.operator import builders as b
from pdserve.operator.settings import OperatorSettings

API_KEY_DIR = "/etc/pdserve-api-key"


def _deployment(cluster: PDCluster, name: str, component: str, replicas: int, container: dict,
                settings: OperatorSettings, strategy: str, *, with_model: bool,
                volumes: tuple[dict, ...] | list[dict] = (),
                mounts: tuple[dict, ...] | list[dict] = (),
                annotations: dict | None = None, is_engine_image: bool = False) -> dict:
    env, shared_volumes, shared_mounts = b.shared_mounts(cluster, with_model=with_model)
    image = settings.engine_image if is_engine_image else settings.image
    container = {"image": cluster.spec.image or image, **container, "env": env,
                 "volumeMounts": [*mounts, *shared_mounts]}
    template_meta = {"labels": b.labels(cluster, component)}
    if annotations:
        template_meta["annotations"] = annotations
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": b.metadata(cluster, name, component),
        "spec": {
            "replicas": replicas,
            "strategy": {"type": strategy},
            "selector": {"matchLabels": b.selector(cluster, component)},
            "template": {
                "metadata": template_meta,
                "spec": {"automountServiceAccountToken": False, "containers": [container],
                         "volumes": [*volumes, *shared_volumes]},
            },
        },
    }


def _http_probe(path: str, port: str, period_s: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period_s}


def controller_settings(cluster: PDCluster) -> dict:
    """What ``pdserve controller`` reads from the cluster file (``controller/cli.py``
    ``build_settings``): the cluster name, heartbeats, fallback, which pools exist, and
    with the planner on, its settings and the SLO it plans for. The pool sizes are its
    start only (the planner keeps its own after that): scaling rolls no Controller."""
    spec = cluster.spec
    planner = ({"planner": spec.planner.to_manifest(), "slo": spec.slo.to_manifest()}
               if spec.planner.enabled else {})
    return {"name": cluster.metadata.name, "heartbeat": spec.heartbeat.to_manifest(),
            "fallback": spec.fallback.to_manifest(),
            "pools": [p for p in b.POOLS if getattr(spec, p).replicas > 0], **planner}


def build_controller_deployment(cluster: PDCluster, settings: OperatorSettings) -> dict:
    component = cluster.spec.controller
    # Two Controllers on two memory stores would both lead: without etcd, run one.
    replicas = component.replicas if settings.etcd_endpoints else min(component.replicas, 1)
    container = {
        "name": "controller",
        "args": ["controller", "-f", b.CONFIG_FILE, "--store", settings.store_url,
                 "--host", "$(POD_IP)", "--port", str(b.CONTROLLER_GRPC_PORT),
                 "--http-port", str(b.CONTROLLER_HTTP_PORT),
                 "--advertise", f"$(POD_IP):{b.CONTROLLER_GRPC_PORT}"],
        "ports": [{"name": "grpc", "containerPort": b.CONTROLLER_GRPC_PORT},
                  {"name": "http", "containerPort": b.CONTROLLER_HTTP_PORT}],
        "livenessProbe": _http_probe("/healthz", "http", 10),
        "readinessProbe": _http_probe("/leaderz", "http", 2),
        "resources": component.resources.to_manifest(),
    }
    return _deployment(
        cluster, b.controller_service_name(cluster), "controller", replicas, container, settings,
        "Recreate", with_model=False,
        volumes=[{"name": "config", "configMap": {"name": b.config_map_name(cluster)}}],
        mounts=[{"name": "config", "mountPath": b.CONFIG_DIR, "readOnly": True}],
        annotations={b.CONFIG_HASH_ANNOTATION: b.spec_hash(controller_settings(cluster))})


def build_kv_pool_deployment(cluster: PDCluster, settings: OperatorSettings) -> dict:
    """The master of the cluster's shared KV pool (``pdserve kv-pool``); one replica,
    recreated (a second master would be a second, empty pool). The engines hold the
    memory, so a restarted master only costs cache misses until they rejoin. It runs
    the engine image: the master is Mooncake's, which the control-plane image lacks."""
    port = cluster.spec.kv_pool.port
    container = {
        "name": "kv-pool",
        "args": ["kv-pool", "--host", "0.0.0.0", "--port", str(port),
                 "--metrics-port", str(b.KV_POOL_METRICS_PORT)],
        "ports": [{"name": "rpc", "containerPort": port},
                  {"name": "metrics", "containerPort": b.KV_POOL_METRICS_PORT}],
        "readinessProbe": {"tcpSocket": {"port": "rpc"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "rpc"}, "periodSeconds": 10},
    }
    return _deployment(cluster, b.kv_pool_service_name(cluster), "kv-pool", 1, container,
                       settings, "Recreate", with_model=False, is_engine_image=True)


def build_coordinator_deployment(cluster: PDCluster, settings: OperatorSettings) -> dict:
    component = cluster.spec.coordinator
    args = coordinator_argv(cluster, "0.0.0.0", b.COORDINATOR_PORT, b.controller_address(cluster))
    volumes, mounts = [], []
    api_key = cluster.spec.security.api_key_secret
    if api_key is not None:
        args += ["--api-key-file", f"{API_KEY_DIR}/api-key"]
        volumes.append({"name": "api-key", "secret": {
            "secretName": api_key.name, "items": [{"key": api_key.key, "path": "api-key"}]}})
        mounts.append({"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True})
    container = {
        "name": "coordinator",
        "args": args,
        "ports": [{"name": "http", "containerPort": b.COORDINATOR_PORT}],
        "livenessProbe": _http_probe("/health", "http", 10),
        "readinessProbe": _http_probe("/ready", "http", 5),
        "resources": component.resources.to_manifest(),
    }
    return _deployment(cluster, f"{cluster.metadata.name}-coordinator", "coordinator",
                       component.replicas, container, settings, "RollingUpdate", with_model=True,
                       volumes=volumes, mounts=mounts)
