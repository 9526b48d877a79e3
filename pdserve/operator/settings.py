"""The operator's settings: one frozen value built from the environment and flags.

Owns every knob of the operator (what the chart's Deployment sets, as
``PDSERVE_*`` variables, plus timings the tests shorten). Nothing else reads the
environment, so tests build ``OperatorSettings(...)`` directly.

Invariants: ``store_url`` is ``etcd://HOST:PORT`` when etcd endpoints are given,
else ``memory://`` (then the Controller runs one replica: two replicas on two
memory stores would both lead). Three images: ``image`` (the control plane, no torch)
for the Controller and Coordinator, ``engine_image`` (torch and the transports) for
the engine Pods and the KV pool's master, ``vllm_engine_image`` (vLLM's image with
pdserve added) for the engine Pods of clusters whose ``spec.engine.backend`` is
``vllm``; a cluster's ``spec.image`` replaces all three (``pods.engine_image_for``
picks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_IMAGE = "ghcr.io/pdserve/pdserve:latest"
DEFAULT_ENGINE_IMAGE = "ghcr.io/pdserve/pdserve-engine:latest"
DEFAULT_VLLM_ENGINE_IMAGE = "ghcr.io/pdserve/pdserve-vllm:latest"


@dataclass(frozen=True)
class OperatorSettings:
    namespace: str = ""
    """Namespace to watch; empty watches every namespace."""
    operator_namespace: str = "default"
    image: str = DEFAULT_IMAGE
    """Control-plane image (Controller, Coordinator) of clusters that set no ``spec.image``."""
    engine_image: str = DEFAULT_ENGINE_IMAGE
    """Engine image (engine Pods, the KV pool's master) of clusters that set no ``spec.image``."""
    vllm_engine_image: str = DEFAULT_VLLM_ENGINE_IMAGE
    """Engine image of clusters with ``spec.engine.backend: vllm`` that set no ``spec.image``."""
    etcd_endpoints: tuple[str, ...] = ()
    key_secret: str = "pdserve-operator-key"
    """Secret in ``operator_namespace`` holding the key cluster tokens derive from
    (``tokens.py``); the operator creates it on first use."""
    metrics_port: int = 8080
    log_level: str = "info"
    resync_s: float = 10.0
    """Every cluster is reconciled at least this often (level-triggered)."""
    drain_deadline_s: float = 120.0
    """A scaled-down instance is deleted when drained or after this long."""
    forget_deadline_s: float = 60.0
    """On deletion, how long to retry asking the Controller to forget the cluster."""
    api_concurrency: int = 8
    """API calls on many instances within one step of a pass (creates, deletes, status
    writes), at most this many at once (``reconcile.Reconciler._each``)."""
    controller_address: str = "{cluster}-controller.{namespace}.svc:{port}"
    """How the operator reaches a cluster's Controller (tests point it at a fake)."""

    @property
    def store_url(self) -> str:
        if not self.etcd_endpoints:
            return "memory://"
        parts = urlsplit(self.etcd_endpoints[0] if "//" in self.etcd_endpoints[0]
                         else "//" + self.etcd_endpoints[0])
        return f"etcd://{parts.hostname}:{parts.port or 2379}"

    @classmethod
    def from_env(cls, env: dict | None = None, **overrides) -> OperatorSettings:
        """Called by ``pdserve operator``: the chart's variables, then flag overrides.
        Without ``PDSERVE_ENGINE_IMAGE`` (an older chart's one image for everything) the
        engines run ``PDSERVE_CLUSTER_IMAGE`` too; without ``PDSERVE_VLLM_ENGINE_IMAGE``
        (a chart older than it) vLLM engines run the engine image, as they did then."""
        env = os.environ if env is None else env
        endpoints = tuple(e.strip() for e in env.get("PDSERVE_ETCD_ENDPOINTS", "").split(",") if e.strip())
        values = dict(
            namespace=env.get("PDSERVE_WATCH_NAMESPACE", ""),
            operator_namespace=env.get("POD_NAMESPACE", "default"),
            image=env.get("PDSERVE_CLUSTER_IMAGE") or DEFAULT_IMAGE,
            engine_image=(env.get("PDSERVE_ENGINE_IMAGE") or env.get("PDSERVE_CLUSTER_IMAGE")
                          or DEFAULT_ENGINE_IMAGE),
            vllm_engine_image=(env.get("PDSERVE_VLLM_ENGINE_IMAGE") or env.get("PDSERVE_ENGINE_IMAGE")
                               or env.get("PDSERVE_CLUSTER_IMAGE") or DEFAULT_VLLM_ENGINE_IMAGE),
            etcd_endpoints=endpoints,
            key_secret=env.get("PDSERVE_KEY_SECRET") or "pdserve-operator-key",
            metrics_port=int(env.get("PDSERVE_METRICS_PORT") or 8080),
            log_level=env.get("PDSERVE_LOG_LEVEL", "info"),
            api_concurrency=int(env.get("PDSERVE_API_CONCURRENCY") or 8),
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
