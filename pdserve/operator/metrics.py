"""The operator's metrics and its small HTTP server: ``/metrics`` and ``/healthz``.

Owns ``pdserve_operator_reconciles_total`` (by trigger and result) and
``pdserve_operator_errors_total`` (by kind: invalid, api, controller, other),
each in a registry of its own so tests can run several operators in one process.

Invariants: ``/healthz`` answers 200 only while the kopf operator task runs (the
chart's liveness probe restarts a pod whose operator loop died).
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from pdserve.runtime.http import create_side_app


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter("pdserve_operator_reconciles", "Reconcile passes of PDClusters",
                                  ["trigger", "result"], registry=self.registry)
        self.errors = Counter("pdserve_operator_errors", "Reconcile passes that failed",
                              ["kind"], registry=self.registry)

    def count(self, trigger: str, error_kind: str | None = None) -> None:
        """Called by the handlers after every pass."""
        self.reconciles.labels(trigger, "error" if error_kind else "ok").inc()
        if error_kind:
            self.errors.labels(error_kind).inc()

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def create_http_app(metrics: OperatorMetrics, is_alive: Callable[[], bool]) -> web.Application:
    def healthz() -> tuple[bool, str]:
        if is_alive():
            return True, "ok\n"
        return False, "operator loop not running\n"

    return create_side_app(metrics.registry, {"/healthz": healthz})
