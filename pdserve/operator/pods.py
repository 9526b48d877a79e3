"""Pure builders of a pool's engines: the cluster file they read and their Pods (one
``pdserve nodeagent`` supervising one engine each).

Owns what an engine Pod of a pool consumes, and nothing else: ``engine_settings``
(the part of the spec the agent reads from its cluster file: model, engine and KV
transfer settings, the heartbeat interval, the pool's threads), the immutable
ConfigMap holding it (named by its hash), and the Pod (agent arguments, probes,
resources and GPUs, placement, the shared token/TLS/model volumes). The Pod is
named after its PDInstance and owned by it.

``engine_image_for`` is the one choice of an engine Pod's image: ``spec.image``, else
the operator's vLLM engine image for ``backend: vllm``, else its engine image.

``engine_pod_hash`` hashes the Pod as built for a placeholder instance: the Pods of
a pool run the same settings exactly when they carry the same hash
(``SPEC_HASH_LABEL``). Routing, fallback, SLOs, heartbeat thresholds, replica counts
and the Coordinator and Controller are not in it, so changing them never touches an
engine; a change that is in it rolls the pool Pod by Pod (``rollout.py``).

Where Pods are created: ``Reconciler._apply_engine_pods`` (``reconcile.py``) is
the one caller of ``build_engine_pod`` and the one place that creates engine
Pods (a missing Pod, a failed one, one the Controller asked to replace, and each
Pod of a settings rollout); ``kube.KubeClient.create`` sends it.

Invariants: the operator never patches a Pod, it deletes and recreates it, and an
engine ConfigMap's content never changes (its name is its hash), so a running
Pod's settings are exactly those of its hash. The agent runs the instance in its
*pool* role; role switches at run time are the Controller's and do not change the
Pod.
"""

from __future__ import annotations

from pdserve.api import PDCluster
from pdserve.api.common import API_VERSION
from pdserve.api.instance import Pool
from pdserve.operator import builders as b
from pdserve.operator.settings import OperatorSettings

PLACEHOLDER_INSTANCE = "{instance}"
"""Stands for the instance name in the Pod ``engine_pod_hash`` hashes."""
COMPILE_CACHE_DIR = "/var/cache/pdserve/compile"  # TORCHINDUCTOR_CACHE_DIR of engine Pods


def engine_settings(cluster: PDCluster, pool: Pool) -> dict:
    """The spec as an engine Pod of ``pool`` reads it (``pdserve nodeagent -f``: see
    ``pdserve.nodeagent.engine_args.build_engine_argv``). Replica counts are not the
    spec's (the agent reads none): 1 for ``pool``, 0 for the others, which keeps the file
    a valid PDCluster whatever the other pools' GPUs and parallelism, and scaling out of
    the hash. Every pool's parallelism is kept (the spec's rule relates them), and the
    pool's threads and GPUs (an engine on GPUs runs without a KV transport); the KV pool
    when enabled (its segment size is an engine flag)."""
    spec = cluster.spec
    model = spec.model.to_manifest()
    model.pop("servedName", None)  # the Coordinator's
    pools = {p: {"replicas": int(p == pool), "parallelism": getattr(spec, p).parallelism.to_manifest()}
             for p in b.POOLS}
    if getattr(spec, pool).threads:
        pools[pool]["threads"] = getattr(spec, pool).threads
    if getattr(spec, pool).gpus:
        pools[pool]["gpus"] = getattr(spec, pool).gpus
    pool_spec = {"kvPool": spec.kv_pool.to_manifest()} if spec.kv_pool.enabled else {}
    return {"model": model, "engine": spec.engine.to_manifest(),
            "kvTransfer": spec.kv_transfer.to_manifest(), **pool_spec,
            "heartbeat": {"intervalSeconds": spec.heartbeat.interval_seconds}, **pools}


def engine_config_name(cluster: PDCluster, pool: Pool) -> str:
    return f"{cluster.metadata.name}-{pool}-engine-{b.spec_hash(engine_settings(cluster, pool))}"


def build_engine_config_map(cluster: PDCluster, pool: Pool) -> dict:
    """The cluster file of ``pool``'s engine Pods; immutable, named by its content."""
    meta = b.metadata(cluster, engine_config_name(cluster, pool), "engine-config",
                      **{b.POOL_LABEL: pool})
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "immutable": True,
            "data": {"cluster.yaml": b.build_cluster_yaml(cluster, engine_settings(cluster, pool))}}


def _resources(pool_spec) -> dict:
    requests = {k: str(v) for k, v in pool_spec.resources.requests.items()}
    limits = {k: str(v) for k, v in pool_spec.resources.limits.items()}
    if pool_spec.gpus:  # device-plugin resources: the request must equal the limit
        limits[pool_spec.gpu_resource] = requests[pool_spec.gpu_resource] = str(pool_spec.gpus)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def engine_host(cluster: PDCluster, instance: str) -> str:
    """The address an engine binds and announces: the Pod's IP, or with TLS its DNS
    name under the headless Service (certificates can name it, not a Pod IP)."""
    if cluster.spec.security.tls_secret:
        return f"{instance}.{b.engines_service_name(cluster)}.{cluster.metadata.namespace}.svc"
    return "$(POD_IP)"


def agent_args(cluster: PDCluster, instance: str, pool: Pool) -> list[str]:
    args = ["nodeagent", "--controller", b.controller_address(cluster),
            "--instance", f"{instance}={pool}",
            "-f", b.CONFIG_FILE, "--agent-id", instance, "--host", "$(POD_IP)",
            "--http-port", str(b.AGENT_HTTP_PORT)]
    if cluster.spec.engine.backend == "vllm":
        # vLLM's flags come from the spec (nodeagent/vllm_args.py); it listens, and its
        # KV side channel too, on the Pod's address
        return args + ["--engine-host", "$(POD_IP)"]
    # peers reach the engine and its KV transport on the Pod's address
    args += [f"--engine-arg=--host={engine_host(cluster, instance)}", "--engine-arg=--kv-host=$(POD_IP)",
             f"--engine-arg=--metrics-port={b.ENGINE_METRICS_PORT}"]
    if getattr(cluster.spec, pool).gpus:
        args.append("--engine-arg=--device=cuda")
    if cluster.spec.kv_pool.enabled:
        args.append(f"--engine-arg=--kv-pool={b.kv_pool_address(cluster)}")
    return args


def _placement(cluster: PDCluster, pool: Pool) -> dict:
    """nodeSelector, tolerations, pod anti-affinity and topology spread of ``pool``."""
    spec = getattr(cluster.spec, pool)
    out: dict = {}
    if spec.node_selector:
        out["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        out["tolerations"] = [t.to_manifest() for t in spec.tolerations]
    same_pool = {"matchLabels": b.pool_selector(cluster, pool)}
    if spec.anti_affinity:
        term = {"labelSelector": same_pool, "topologyKey": "kubernetes.io/hostname"}
        rule = ({"requiredDuringSchedulingIgnoredDuringExecution": [term]}
                if spec.anti_affinity == "required" else
                {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]})
        out["affinity"] = {"podAntiAffinity": rule}
    if spec.topology_spread:
        out["topologySpreadConstraints"] = [
            {"maxSkew": t.max_skew, "topologyKey": t.topology_key,
             "whenUnsatisfiable": t.when_unsatisfiable, "labelSelector": same_pool}
            for t in spec.topology_spread]
    return out


def engine_image_for(cluster: PDCluster, settings: OperatorSettings) -> str:
    """The image of ``cluster``'s engine Pods: a vLLM engine Pod runs ``vllm serve``, so
    its image is vLLM's with pdserve added, not the embedded engine's."""
    if cluster.spec.image:
        return cluster.spec.image
    if cluster.spec.engine.backend == "vllm":
        return settings.vllm_engine_image
    return settings.engine_image


def _pod_spec(cluster: PDCluster, instance: str, pool: Pool, settings: OperatorSettings) -> dict:
    env, volumes, mounts = b.shared_mounts(cluster, with_model=True)
    # torch.compile's code cache (the embedded engine's compiled prefill, vLLM's graphs) in a
    # volume of the Pod: a restarted container compiles from it in seconds.
    env = [*env, {"name": "TORCHINDUCTOR_CACHE_DIR", "value": COMPILE_CACHE_DIR}]
    volumes = [*volumes, {"name": "compile-cache", "emptyDir": {}}]
    mounts = [*mounts, {"name": "compile-cache", "mountPath": COMPILE_CACHE_DIR}]
    container = {
        "name": "nodeagent",
        "image": engine_image_for(cluster, settings),
        "args": agent_args(cluster, instance, pool),
        "env": env,
        "ports": [{"name": "http", "containerPort": b.AGENT_HTTP_PORT},
                  {"name": "metrics", "containerPort": b.ENGINE_METRICS_PORT}],
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"},
                          "periodSeconds": 10, "failureThreshold": 3},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"},
                           "periodSeconds": 5, "failureThreshold": 2},
        "resources": _resources(getattr(cluster.spec, pool)),
        "volumeMounts": [{"name": "config", "mountPath": b.CONFIG_DIR, "readOnly": True}, *mounts],
    }
    return {
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": engine_config_name(cluster, pool)}},
                    *volumes],
        "hostname": instance,
        "subdomain": b.engines_service_name(cluster),
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 30,
        "automountServiceAccountToken": False,  # nothing in an engine Pod calls the API
        **_placement(cluster, pool),
    }


def engine_pod_hash(cluster: PDCluster, pool: Pool, settings: OperatorSettings) -> str:
    """The settings hash of ``pool``'s engine Pods under the operator's ``settings``
    (their image is in it)."""
    return b.spec_hash(_pod_spec(cluster, PLACEHOLDER_INSTANCE, pool, settings))


def build_engine_pod(cluster: PDCluster, instance: str, pool: Pool, instance_uid: str | None,
                     settings: OperatorSettings) -> dict:
    """The Pod of PDInstance ``instance``. Called by ``Reconciler._apply_engine_pods``
    when the Pod is missing (never there, deleted as failed, replaced or stale)."""
    meta = b.metadata(cluster, instance, "engine", **{
        b.POOL_LABEL: pool, b.INSTANCE_LABEL: instance,
        b.SPEC_HASH_LABEL: engine_pod_hash(cluster, pool, settings)})
    meta["ownerReferences"] = [b.owner_reference(API_VERSION, "PDInstance", instance, instance_uid)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": _pod_spec(cluster, instance, pool, settings)}
