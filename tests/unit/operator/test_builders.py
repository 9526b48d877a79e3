"""Builders are pure: the desired objects follow from the spec alone."""

from __future__ import annotations

import yaml

from pdserve.api import PDCluster
from pdserve.api.manifest import load_manifest, parse_manifest
from pdserve.operator import builders as b
from pdserve.operator.deployments import build_controller_deployment, build_coordinator_deployment
from pdserve.operator.desired import build_static_objects
from pdserve.operator.pods import (
    COMPILE_CACHE_DIR,
    build_engine_config_map,
    build_engine_pod,
    engine_pod_hash,
)
from pdserve.operator.settings import OperatorSettings

SETTINGS = OperatorSettings()


def engine_hashes(c: PDCluster) -> dict[str, str]:
    """Pool -> the settings hash of its engine Pods."""
    return {pool: engine_pod_hash(c, pool, SETTINGS) for pool in b.POOLS}


def cluster(**spec) -> PDCluster:
    base = {"model": {"preset": "tiny"}, "prefill": {"replicas": 2}, "decode": {"replicas": 1}}
    return parse_manifest({"apiVersion": "pdserve.io/v1alpha1", "kind": "PDCluster",
                           "metadata": {"name": "c", "namespace": "ns", "uid": "u-1", "generation": 3},
                           "spec": {**base, **spec}})


def test_building_twice_gives_equal_objects_all_owned_and_labelled():
    c, settings = cluster(), OperatorSettings()
    def build():
        return [*build_static_objects(c, settings), b.build_token_secret(c, "t"),
                b.build_instance(c, "decode", 0)]
    first, second = build(), build()
    assert first == second
    for obj in first:
        assert obj["metadata"]["labels"][b.CLUSTER_LABEL] == "c"
        assert obj["metadata"]["ownerReferences"] == [b.cluster_owner(c)]
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_one_instance_per_pool_replica():
    assert b.desired_instances(cluster()) == {
        "c-prefill-0": ("prefill", 0), "c-prefill-1": ("prefill", 1), "c-decode-0": ("decode", 0)}
    inst = b.build_instance(cluster(), "prefill", 1)
    assert inst["spec"] == {"role": "prefill", "cluster": "c", "pool": "prefill", "ordinal": 1}


def test_engine_hash_ignores_scaling_and_control_plane_but_not_engine_settings():
    base = engine_hashes(cluster())
    assert engine_hashes(cluster(decode={"replicas": 5})) == base
    assert engine_hashes(cluster(coordinator={"replicas": 3})) == base
    assert engine_hashes(cluster(engine={"blockSize": 32})) != base
    assert engine_hashes(cluster(kvTransfer={"mode": "pull"})) != base
    assert b.config_hash(cluster(coordinator={"replicas": 3})) != b.config_hash(cluster())


def test_engine_pod_runs_the_agent_with_probes_gpus_and_placement():
    c = cluster(hybrid={"replicas": 1, "gpus": 2, "nodeSelector": {"gpu": "h100"},
                        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                        "resources": {"requests": {"cpu": "4", "memory": "16Gi"}}})
    settings = OperatorSettings(engine_image="img:1")
    pod = build_engine_pod(c, "c-hybrid-0", "hybrid", "inst-uid", settings)
    container = pod["spec"]["containers"][0]
    assert container["args"][:5] == ["nodeagent", "--controller", "c-controller:50050",
                                     "--instance", "c-hybrid-0=hybrid"]
    assert container["args"][5:7] == ["-f", b.CONFIG_FILE]
    assert "--engine-arg=--device=cuda" in container["args"]
    assert container["resources"] == {"requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "2"},
                                      "limits": {"nvidia.com/gpu": "2"}}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert pod["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["metadata"]["labels"][b.SPEC_HASH_LABEL] == engine_pod_hash(c, "hybrid", settings)
    assert pod["metadata"]["ownerReferences"][0] == {
        "apiVersion": "pdserve.io/v1alpha1", "kind": "PDInstance", "name": "c-hybrid-0",
        "uid": "inst-uid", "controller": True, "blockOwnerDeletion": True}
    assert container["image"] == "img:1"


def test_a_vllm_engine_pod_runs_the_agent_on_the_pods_address_with_gpus_in_pd_pools():
    c = cluster(model={"pvc": {"claimName": "weights", "subPath": "qwen"}},
                engine={"backend": "vllm", "vllm": {"command": ["vllm", "serve"]}},
                kvTransfer={"mode": "pull", "transport": "nixl"},
                prefill={"replicas": 1, "gpus": 1}, decode={"replicas": 1, "gpus": 1})
    container = build_engine_pod(c, "c-prefill-0", "prefill", "u", SETTINGS)["spec"]["containers"][0]
    args = container["args"]
    assert args[:5] == ["nodeagent", "--controller", "c-controller:50050", "--instance", "c-prefill-0=prefill"]
    assert args[args.index("--engine-host") + 1] == "$(POD_IP)"
    assert not [a for a in args if a.startswith("--engine-arg")]  # the embedded engine's flags
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}


def test_engine_pods_keep_torch_compiles_cache_in_a_volume_of_the_pod():
    """A restarted engine container finds the code its compiled prefill built before."""
    spec = build_engine_pod(cluster(), "c-prefill-0", "prefill", "u", SETTINGS)["spec"]
    [container] = spec["containers"]
    mount = {"name": "compile-cache", "mountPath": COMPILE_CACHE_DIR}
    assert {"name": "compile-cache", "emptyDir": {}} in spec["volumes"] and mount in container["volumeMounts"]
    assert {"name": "TORCHINDUCTOR_CACHE_DIR", "value": COMPILE_CACHE_DIR} in container["env"]


def test_pvc_weights_are_mounted_read_only():
    """Engines and the Coordinator (its tokenizer) mount the claim read-only at /models,
    and the Coordinator's ``--model`` points inside that mount."""
    c = cluster(model={"pvc": {"claimName": "weights", "subPath": "llama"}})
    pod = build_engine_pod(c, "c-prefill-0", "prefill", "u", SETTINGS)
    volume = {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}
    mount = {"name": "model", "mountPath": "/models", "readOnly": True}
    assert volume in pod["spec"]["volumes"] and mount in pod["spec"]["containers"][0]["volumeMounts"]
    coordinator = build_coordinator_deployment(c, OperatorSettings())["spec"]["template"]["spec"]
    [container] = coordinator["containers"]
    assert volume in coordinator["volumes"] and mount in container["volumeMounts"]
    args = container["args"]
    assert args[args.index("--model") + 1] == "/models/llama"


def test_config_map_holds_the_spec_the_components_load(tmp_path):
    c = cluster(engine={"blockSize": 32})
    path = tmp_path / "cluster.yaml"
    path.write_text(b.build_config_map(c)["data"]["cluster.yaml"])
    loaded = load_manifest(path)
    assert loaded.spec == c.spec and loaded.metadata.name == "c"


def test_controller_uses_etcd_when_given_and_one_replica_without():
    c = cluster(controller={"replicas": 2})
    with_etcd = build_controller_deployment(c, OperatorSettings(etcd_endpoints=("http://etcd.sys.svc:2379",)))
    args = with_etcd["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--store") + 1] == "etcd://etcd.sys.svc:2379"
    assert with_etcd["spec"]["replicas"] == 2 and with_etcd["spec"]["strategy"]["type"] == "Recreate"
    assert build_controller_deployment(c, OperatorSettings())["spec"]["replicas"] == 1
    probe = with_etcd["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert probe["httpGet"]["path"] == "/leaderz"


def test_coordinator_flags_follow_the_spec():
    c = cluster(routing={"prefillPolicy": "round_robin"}, slo={"ttftMs": 500},
                kvTransfer={"mode": "pull", "decodeAllocation": "prefill_complete"})
    args = build_coordinator_deployment(c, OperatorSettings())["spec"]["template"]["spec"][
        "containers"][0]["args"]
    flags = dict(zip(args[1::2], args[2::2], strict=False))
    assert flags["--prefill-policy"] == "round_robin" and flags["--kv-mode"] == "pull"
    assert flags["--ttft-slo-s"] == "0.5" and flags["--served-model-name"] == "c"
    assert flags["--controller"] == "c-controller:50050" and flags["--port"] == "8000"


def test_settings_from_the_charts_environment():
    s = OperatorSettings.from_env({"PDSERVE_WATCH_NAMESPACE": "team", "PDSERVE_METRICS_PORT": "9090",
                                   "PDSERVE_ETCD_ENDPOINTS": "http://e:2379,http://f:2379",
                                   "PDSERVE_CLUSTER_IMAGE": "img:2", "POD_NAMESPACE": "ops"},
                                  resync_s=3.0, drain_deadline_s=None)
    assert (s.namespace, s.metrics_port, s.image, s.operator_namespace) == ("team", 9090, "img:2", "ops")
    assert s.store_url == "etcd://e:2379" and s.resync_s == 3.0 and s.drain_deadline_s == 120.0
    assert OperatorSettings().store_url == "memory://"


def colocated(hybrid: dict | None = None, **spec) -> PDCluster:
    """Two hybrid engines (3 threads, cores 0-1), no prefill or decode replicas."""
    pool = {"replicas": 2, "threads": 3, "cpuAffinity": [0, 1],
            "resources": {"requests": {"cpu": "3"}, "limits": {"cpu": "3"}}, **(hybrid or {})}
    return cluster(**{"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "hybrid": pool, **spec})


def test_hybrid_pool_replicas_are_instances_and_pods_in_their_pool_role():
    c = colocated()
    assert b.desired_instances(c) == {"c-hybrid-0": ("hybrid", 0), "c-hybrid-1": ("hybrid", 1)}
    inst = b.build_instance(c, "hybrid", 1)
    assert inst["spec"] == {"role": "hybrid", "cluster": "c", "pool": "hybrid", "ordinal": 1}
    assert inst["metadata"]["labels"][b.POOL_LABEL] == "hybrid"
    pod = build_engine_pod(c, "c-hybrid-1", "hybrid", "u", SETTINGS)
    container = pod["spec"]["containers"][0]
    assert container["args"][3:5] == ["--instance", "c-hybrid-1=hybrid"]
    assert "--pin-cpus" not in container["args"]  # cpuAffinity is local mode only
    assert container["resources"] == {"requests": {"cpu": "3"}, "limits": {"cpu": "3"}}
    assert pod["metadata"]["labels"][b.POOL_LABEL] == "hybrid"
    mixed = cluster(hybrid={"replicas": 1})
    assert set(b.desired_instances(mixed)) == {"c-prefill-0", "c-prefill-1", "c-decode-0", "c-hybrid-0"}


def test_the_pod_runs_its_pools_threads_and_the_engine_settings(tmp_path):
    """What the agent in a Pod launches: its --instance pool's settings from the ConfigMap."""
    from pdserve.nodeagent.cli import engine_cpus
    from pdserve.nodeagent.engine_args import build_engine_argv

    c = colocated(engine={"prefillChunkTokens": 128}, prefill={"replicas": 1, "threads": 2},
                  decode={"replicas": 0})
    for name, pool, threads in (("c-hybrid-0", "hybrid", "3"), ("c-prefill-0", "prefill", "2")):
        pod = build_engine_pod(c, name, pool, "u", SETTINGS)
        args = pod["spec"]["containers"][0]["args"]
        # the cluster file the Pod mounts (at CONFIG_DIR) is its pool's engine ConfigMap
        [config] = [v["configMap"]["name"] for v in pod["spec"]["volumes"] if "configMap" in v]
        config_map = build_engine_config_map(c, pool)
        assert config_map["metadata"]["name"] == config
        (tmp_path / "cluster.yaml").write_text(config_map["data"]["cluster.yaml"])
        loaded = load_manifest(tmp_path / "cluster.yaml")
        iid, role = args[args.index("--instance") + 1].split("=")
        argv = build_engine_argv(loaded, role)
        assert argv[argv.index("--role") + 1] == pool and argv[argv.index("--threads") + 1] == threads
        assert argv[argv.index("--prefill-chunk-tokens") + 1] == "128"
        # cpuAffinity is local mode's: the engine file leaves it out, so nothing is pinned
        assert engine_cpus(loaded, iid, role) == ()
        assert engine_cpus(c, iid, role) == (() if pool == "prefill" else (0, 1))


def test_engine_hash_ignores_hybrid_scaling_and_cpu_affinity_but_not_threads():
    base = engine_hashes(colocated())
    assert engine_hashes(colocated({"replicas": 5, "cpuAffinity": [7]})) == base
    assert engine_hashes(colocated({"threads": 4})) != base


def test_coordinator_args_are_the_shared_mapping_with_in_cluster_addresses():
    from pdserve.api.component_args import coordinator_argv

    c = cluster(model={"preset": "tiny", "servedName": "m"}, routing={"decodePolicy": "round_robin"})
    args = build_coordinator_deployment(c, OperatorSettings())["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert args == coordinator_argv(c, "0.0.0.0", 8000, "c-controller:50050")
    assert args[:7] == ["coordinator", "--host", "0.0.0.0", "--port", "8000",
                        "--controller", "c-controller:50050"]


def test_an_image_model_reaches_the_coordinator_too():
    c = cluster(model={"image": "registry.example/weights:1"})
    coordinator = build_coordinator_deployment(c, OperatorSettings())["spec"]["template"]["spec"]
    assert {"name": "model", "image": {"reference": "registry.example/weights:1",
                                       "pullPolicy": "IfNotPresent"}} in coordinator["volumes"]
    [container] = coordinator["containers"]
    args = container["args"]
    assert args[args.index("--model") + 1] == "/models/"
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    # presets and in-image paths need no volume
    plain = build_coordinator_deployment(cluster(), OperatorSettings())["spec"]["template"]["spec"]
    assert "model" not in {v["name"] for v in plain["volumes"]}


def test_pools_spread_over_nodes_and_topologies_as_asked():
    c = cluster(decode={"replicas": 2, "antiAffinity": "required",
                        "topologySpread": [{"topologyKey": "topology.kubernetes.io/zone"}]},
                prefill={"replicas": 1, "antiAffinity": "preferred"})
    same_pool = {"matchLabels": {b.CLUSTER_LABEL: "c", b.COMPONENT_LABEL: "engine", b.POOL_LABEL: "decode"}}
    decode = build_engine_pod(c, "c-decode-0", "decode", "u", SETTINGS)["spec"]
    assert decode["affinity"] == {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": same_pool, "topologyKey": "kubernetes.io/hostname"}]}}
    assert decode["topologySpreadConstraints"] == [{
        "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": same_pool}]
    prefill = build_engine_pod(c, "c-prefill-0", "prefill", "u", SETTINGS)["spec"]
    [preferred] = prefill["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["podAffinityTerm"]["labelSelector"]["matchLabels"][b.POOL_LABEL] == "prefill"
    plain = build_engine_pod(cluster(), "c-decode-0", "decode", "u", SETTINGS)["spec"]
    assert "affinity" not in plain and "topologySpreadConstraints" not in plain


def test_one_disruption_budget_per_pool_with_replicas():
    budgets = {p["metadata"]["name"]: p for p in b.build_disruption_budgets(cluster())}
    assert set(budgets) == {"c-prefill", "c-decode"}  # no hybrid replicas
    assert budgets["c-decode"]["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {
        b.CLUSTER_LABEL: "c", b.COMPONENT_LABEL: "engine", b.POOL_LABEL: "decode"}}}
    assert {p["metadata"]["name"] for p in b.build_disruption_budgets(colocated())} == {"c-hybrid"}


def test_every_object_is_part_of_pdserve():
    for obj in build_static_objects(cluster(), OperatorSettings()):
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdserve"
        assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "pdserve"


def test_controller_and_agents_listen_only_on_their_pod_address():
    """Secure by default: the internal listeners bind the address they announce, which
    the kubelet expands from the Pod's ``POD_IP`` (fieldRef status.podIP)."""
    c = cluster(prefill={"replicas": 1})
    controller = build_controller_deployment(c, OperatorSettings())["spec"]["template"]["spec"]
    agent = build_engine_pod(c, "c-prefill-0", "prefill", "inst-uid", SETTINGS)["spec"]
    for spec in (controller, agent):
        container = spec["containers"][0]
        args = container["args"]
        assert args[args.index("--host") + 1] == "$(POD_IP)"
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert "0.0.0.0" not in args


def test_a_kv_pool_gets_its_master_deployment_and_service_and_every_engine_joins_it():
    from tests.unit.chart.kube_schemas import validation_errors

    c, settings = cluster(kvPool={"enabled": True, "segmentSize": "64Mi", "port": 50600}), OperatorSettings()
    objs = {(o["kind"], o["metadata"]["name"]): o for o in build_static_objects(c, settings)}
    master = objs[("Deployment", "c-kv-pool")]
    container = master["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["kv-pool", "--host", "0.0.0.0", "--port", "50600",
                                 "--metrics-port", str(b.KV_POOL_METRICS_PORT)]
    assert master["spec"]["replicas"] == 1 and master["spec"]["strategy"] == {"type": "Recreate"}
    service = objs[("Service", "c-kv-pool")]
    assert service["spec"]["selector"] == b.selector(c, "kv-pool")
    assert {p["port"] for p in service["spec"]["ports"]} == {50600, b.KV_POOL_METRICS_PORT}
    for obj in (master, service):
        assert validation_errors(obj, "1.33") == []
    for pool in ("prefill", "decode"):
        args = build_engine_pod(c, f"c-{pool}-0", pool, "uid", SETTINGS)["spec"]["containers"][0]["args"]
        assert "--engine-arg=--kv-pool=c-kv-pool:50600" in args
        engine_file = yaml.safe_load(build_engine_config_map(c, pool)["data"]["cluster.yaml"])
        assert engine_file["spec"]["kvPool"]["segmentSize"] == "64Mi"  # the engine's segment flag
    off = cluster()
    assert not [o for o in build_static_objects(off, settings) if "kv-pool" in o["metadata"]["name"]]
    assert engine_hashes(c) != engine_hashes(off)  # enabling the pool rolls the engines
