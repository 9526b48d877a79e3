"""Pure builder of an engine Pod: one ``pdserve nodeagent`` supervising one engine.

Owns the Pod of a PDInstance: the agent's arguments (Controller address, the
instance, the cluster file), probes, resources and GPUs, node placement, the
config and model volumes. The Pod is named after its PDInstance and owned by it.

Where Pods are created: ``Reconciler._apply_engine_pods`` (``reconcile.py``) is
the one caller of ``build_engine_pod`` and the one place that creates engine
Pods (a missing Pod, a failed one, one the Controller asked to replace, and each
Pod of a settings rollout); ``kube.KubeClient.create`` sends it.

Invariants: the Pod carries the engine-settings hash (``SPEC_HASH_LABEL``); the
operator never patches a Pod, it deletes and recreates it, so a running Pod's
settings are exactly those of its hash. The agent runs the instance in its *pool*
role; role switches at run time are the Controller's and do not change the Pod.
"""

from __future__ import annotations

from pdserve.api import PDCluster
from pdserve.api.common import API_VERSION
from pdserve.api.component_args import MODEL_DIR
from pdserve.operator import builders as b


def _resources(pool) -> dict:
    requests = {k: str(v) for k, v in pool.resources.requests.items()}
    limits = {k: str(v) for k, v in pool.resources.limits.items()}
    if pool.gpus:  # device-plugin resources: the request must equal the limit
        limits[pool.gpu_resource] = requests[pool.gpu_resource] = str(pool.gpus)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _model_volume(cluster: PDCluster) -> dict | None:
    model = cluster.spec.model
    if model.pvc is not None:
        return {"name": "model", "persistentVolumeClaim": {"claimName": model.pvc.claim_name,
                                                           "readOnly": True}}
    if model.image is not None:
        return {"name": "model", "image": {"reference": model.image, "pullPolicy": "IfNotPresent"}}
    return None


def agent_args(cluster: PDCluster, instance: str, pool: str) -> list[str]:
    controller = f"{b.controller_service_name(cluster)}:{b.CONTROLLER_GRPC_PORT}"
    args = ["nodeagent", "--controller", controller, "--instance", f"{instance}={pool}",
            "-f", b.CONFIG_FILE, "--agent-id", instance, "--host", "0.0.0.0",
            "--http-port", str(b.AGENT_HTTP_PORT),
            # peers reach the engine and its KV transport on the Pod's IP
            "--engine-arg=--host=$(POD_IP)", "--engine-arg=--kv-host=$(POD_IP)",
            f"--engine-arg=--metrics-port={b.ENGINE_METRICS_PORT}"]
    if getattr(cluster.spec, pool).gpus:
        args.append("--engine-arg=--device=cuda")
    return args


def build_engine_pod(cluster: PDCluster, instance: str, pool: str, instance_uid: str | None,
                     image: str) -> dict:
    """The Pod of PDInstance ``instance``. Called by ``Reconciler._apply_engine_pods``
    when the Pod is missing (never there, deleted as failed, replaced or stale)."""
    spec = getattr(cluster.spec, pool)
    mounts = [{"name": "config", "mountPath": b.CONFIG_DIR, "readOnly": True}]
    volumes = [{"name": "config", "configMap": {"name": b.config_map_name(cluster)}}]
    model = _model_volume(cluster)
    if model is not None:
        volumes.append(model)
        mounts.append({"name": "model", "mountPath": MODEL_DIR, "readOnly": True})
    container = {
        "name": "nodeagent",
        "image": cluster.spec.image or image,
        "args": agent_args(cluster, instance, pool),
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": b.AGENT_HTTP_PORT},
                  {"name": "metrics", "containerPort": b.ENGINE_METRICS_PORT}],
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"},
                          "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"},
                           "periodSeconds": 5, "failureThreshold": 2},
        "resources": _resources(spec),
        "volumeMounts": mounts,
    }
    pod_spec = {
        "containers": [container],
        "volumes": volumes,
        "hostname": instance,
        "subdomain": f"{cluster.metadata.name}-engines",
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.to_manifest() for t in spec.tolerations]
    meta = b.metadata(cluster, instance, "engine", **{
        b.POOL_LABEL: pool, b.INSTANCE_LABEL: instance, b.SPEC_HASH_LABEL: b.engine_spec_hash(cluster)})
    meta["ownerReferences"] = [b.owner_reference(API_VERSION, "PDInstance", instance, instance_uid)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
