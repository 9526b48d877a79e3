"""The values the chart is rendered with in these tests: the defaults and one set per
thing a user changes. Each set is small, so a failure names the knob that broke.
Every key used here is in values.yaml (``test_value_sets_are_valid_values``).
"""

from __future__ import annotations

VALUE_SETS: dict[str, dict] = {
    "defaults": {},
    "external-etcd": {"etcd": {"enabled": False,
                               "endpoints": ["http://etcd-0.db:2379", "https://etcd-1.db:2379"]}},
    "etcd-ha-persistent": {"etcd": {"replicas": 3, "persistence": {
        "enabled": True, "size": "10Gi", "storageClass": "fast-ssd"}}},
    "monitoring": {"metrics": {"serviceMonitor": {"enabled": True, "interval": "15s",
                                                  "labels": {"release": "prom"}}},
                   "dashboards": {"namespace": "monitoring", "labels": {"team": "ml"}}},
    "no-dashboards": {"dashboards": {"enabled": False}},
    "namespaced": {"operator": {"watchNamespace": "team-a", "logLevel": "debug",
                                "metricsPort": 9090, "apiConcurrency": 16},
                   "metrics": {"serviceMonitor": {"enabled": True}}},
    "images": {"image": {"repository": "registry.example/pdserve", "tag": "1.2.3",
                         "pullPolicy": "Always"},
               "imagePullSecrets": [{"name": "regcred"}],
               "operator": {"clusterImage": "registry.example/pdserve:1.2.3-cuda"},
               "etcd": {"image": {"repository": "registry.example/etcd", "tag": "v3.5.21",
                                  "pullPolicy": "Never"}}},
    "engine-image": {"image": {"repository": "registry.example/pdserve", "tag": "1.2.3",
                               "pullPolicy": "IfNotPresent"},
                     "engineImage": {"repository": "registry.example/pdserve-engine",
                                     "tag": "1.2.3-cu128"},
                     "vllmEngineImage": {"repository": "registry.example/pdserve-vllm",
                                         "tag": "1.2.3-vllm0.32"}},
    "placement": {"operator": {
        "resources": {"requests": {"cpu": "250m", "memory": "300Mi"},
                      "limits": {"cpu": 1, "memory": "1Gi"}},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops",
                         "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "node-role", "operator": "In", "values": ["ops"]}]}]}}},
        "podAnnotations": {"example.com/scrape": "true"}},
        "etcd": {"resources": {"requests": {"cpu": "50m"}, "limits": {"memory": "512Mi"}}}},
    "existing-account-no-rbac": {"serviceAccount": {"create": False, "name": "pdserve-ops"},
                                 "rbac": {"create": False}},
    "account-annotations": {"serviceAccount": {"name": "ops",
                                               "annotations": {"iam.example/role": "pdserve"}}},
    "operator-tls": {"operator": {"tlsSecret": "operator-certs"}},
    "names": {"fullnameOverride": "pds", "nameOverride": "pdsrv",
              "metrics": {"serviceMonitor": {"enabled": True}}},
}
