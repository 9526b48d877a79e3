"""The kopf handlers: thin adapters from kopf's triggers to ``Reconciler``.

Owns ``register``: which triggers reconcile a PDCluster (create, update, resume,
a resync timer, and any change of its Pods, PDInstances or PDPools: a PDPool's
scale is read by the PDCluster's pass, ``pdpools.py``; a child's event while a pass
waits to start costs nothing: that pass reads it), the delete handler
(kopf's finalizer keeps the PDCluster until ``Reconciler.finalize`` returns), the
mapping of errors onto kopf's retry semantics, events and metrics.

Invariants: an invalid spec is a ``kopf.PermanentError`` on create/update (the
status already says why; a later update is tried again); Kubernetes API failures
and waits are ``kopf.TemporaryError`` with a delay; kopf keeps its progress in
annotations (the CRD's status has no ``kopf`` field); with one watched namespace
kopf never reads cluster-scoped resources (the namespaced RBAC mode grants none).
"""

from __future__ import annotations

import logging

import kopf

from pdserve.operator import builders as b
from pdserve.operator.kube import KubeError
from pdserve.operator.metrics import OperatorMetrics
from pdserve.operator.reconcile import Event, InvalidSpec, NotYet, Reconciler

PDCLUSTERS = ("pdserve.io", "v1alpha1", "pdclusters")
CHILD_LABELS = {b.CLUSTER_LABEL: kopf.PRESENT}


def _post(body, events: list[Event]) -> None:
    for e in events:
        kopf.event(e.about or body, type=e.type, reason=e.reason, message=e.message)


def register(registry: kopf.OperatorRegistry, reconciler: Reconciler, metrics: OperatorMetrics,
             *, with_login: bool = True) -> None:
    """Called once by the CLI (and the tests) before ``kopf.operator`` starts."""
    settings = reconciler.settings
    retry_s = min(settings.resync_s, 5.0)

    async def run(body, trigger: str, is_strict: bool) -> None:
        try:
            events = await reconciler.reconcile(body, coalesce=not is_strict)
        except InvalidSpec as exc:
            metrics.count(trigger, "invalid")
            if is_strict:  # once per spec change, not on every resync
                kopf.warn(body, reason="InvalidSpec", message=str(exc))
                raise kopf.PermanentError(f"invalid spec: {exc}") from None
            return
        except KubeError as exc:
            metrics.count(trigger, "api")
            raise kopf.TemporaryError(str(exc), delay=retry_s if exc.is_transient else 6 * retry_s) from None
        except Exception:
            metrics.count(trigger, "other")
            raise
        metrics.count(trigger)
        _post(body, events)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="pdserve.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="pdserve.io", key="last-handled-configuration")
        settings.persistence.finalizer = "pdserve.io/finalizer"
        settings.posting.level = logging.WARNING  # our own events say what was done
        # Watching one namespace the chart grants Roles there only: no CRD or namespace
        # scanning (cluster-wide reads), the resources found at start-up are served.
        settings.scanning.disabled = bool(reconciler.settings.namespace)

    if with_login:
        @kopf.on.login(registry=registry)
        def login(**kwargs):
            return kopf.login_with_service_account(**kwargs) or kopf.login_via_client(**kwargs)

    @kopf.on.resume(*PDCLUSTERS, registry=registry)
    @kopf.on.create(*PDCLUSTERS, registry=registry)
    @kopf.on.update(*PDCLUSTERS, registry=registry)
    async def spec_changed(body, reason, **_) -> None:
        await run(body, str(reason), is_strict=True)

    @kopf.timer(*PDCLUSTERS, interval=settings.resync_s, registry=registry)
    async def resync(body, **_) -> None:
        await run(body, "resync", is_strict=False)

    @kopf.on.event("", "v1", "pods", labels=CHILD_LABELS, registry=registry)
    @kopf.on.event("discovery.k8s.io", "v1", "endpointslices", labels=CHILD_LABELS, registry=registry)
    @kopf.on.event(*PDCLUSTERS[:2], "pdinstances", labels=CHILD_LABELS, registry=registry)
    @kopf.on.event(*PDCLUSTERS[:2], "pdpools", labels=CHILD_LABELS, registry=registry)
    async def child_changed(namespace, labels, logger, **_) -> None:
        name = labels[b.CLUSTER_LABEL]
        if reconciler.is_queued(namespace, name):
            return  # a change of N children is N events: one read and one pass serve them all
        try:
            cluster = await reconciler.kube.get("PDCluster", namespace, name)
            if cluster is not None:
                await run(cluster, "child", is_strict=False)
        except (KubeError, kopf.TemporaryError) as exc:  # the resync timer retries
            logger.debug("reconcile after a child event failed: %s", exc)

    @kopf.on.delete(*PDCLUSTERS, registry=registry)
    async def deleted(body, **_) -> None:
        try:
            events = await reconciler.finalize(body)
        except NotYet as exc:
            raise kopf.TemporaryError(str(exc), delay=retry_s / 2) from None
        except KubeError as exc:
            metrics.count("delete", "api")
            raise kopf.TemporaryError(str(exc), delay=retry_s) from None
        metrics.count("delete")
        _post(body, events)
