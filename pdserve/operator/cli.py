"""``pdserve operator``: settings from the chart's environment and flags, then kopf.

Owns the process: the Kubernetes client, the Controller channels, the metrics and
health server, and ``kopf.operator`` (standalone: the chart runs one replica with a
Recreate strategy). ``serve`` takes every dependency as an argument, so tests run
the same code against an emulator, with a login handler of their own.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import kopf
from aiohttp import web

from pdserve.operator import builders as b
from pdserve.operator.controller_client import ControllerClients
from pdserve.operator.doctor import DoctorRuns
from pdserve.operator.handlers import register
from pdserve.operator.kube import KubeClient
from pdserve.operator.metrics import OperatorMetrics, create_http_app
from pdserve.operator.reconcile import Reconciler
from pdserve.operator.settings import OperatorSettings
from pdserve.runtime.logs import configure_logging
from pdserve.runtime.security import SecuritySettings

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", help="namespace to watch (default: PDSERVE_WATCH_NAMESPACE, or all)")
    p.add_argument("--resync", type=float, help="seconds between resyncs of each cluster")
    p.add_argument("--drain-deadline", type=float, help="seconds a scaled-down instance may drain")
    p.add_argument("--metrics-port", type=int, help="/metrics and /healthz (default: PDSERVE_METRICS_PORT)")
    p.add_argument("--log-level", help="default: PDSERVE_LOG_LEVEL or info")


async def serve(settings: OperatorSettings, kube: KubeClient | None = None,
                controllers: ControllerClients | None = None, *,
                registry: kopf.OperatorRegistry | None = None, with_login: bool = True,
                stop_flag=None, ready_flag=None, metrics: OperatorMetrics | None = None) -> None:
    """Run until ``stop_flag`` is set (or forever). Called by ``run`` and the tests."""
    kube = kube or KubeClient.from_environment()
    security = SecuritySettings.from_env()
    controllers = controllers or ControllerClients(settings.controller_address, security,
                                                   b.CONTROLLER_GRPC_PORT)
    registry = registry if registry is not None else kopf.OperatorRegistry()
    metrics = metrics or OperatorMetrics()
    doctor = DoctorRuns(security)
    register(registry, Reconciler(kube, controllers, settings, doctor=doctor), metrics,
             with_login=with_login)
    task = asyncio.create_task(kopf.operator(
        registry=registry, standalone=True, clusterwide=not settings.namespace,
        namespaces=[settings.namespace] if settings.namespace else (),
        stop_flag=stop_flag, ready_flag=ready_flag))
    runner = None
    if settings.metrics_port >= 0:
        runner = web.AppRunner(create_http_app(metrics, lambda: not task.done()))
        await runner.setup()
        await web.TCPSite(runner, "0.0.0.0", settings.metrics_port).start()
    try:
        await task
    finally:
        if runner is not None:
            await runner.cleanup()
        await doctor.close()
        await controllers.close()
        await kube.close()


def run(args: argparse.Namespace) -> int:
    settings = OperatorSettings.from_env(
        namespace=args.namespace, resync_s=args.resync, drain_deadline_s=args.drain_deadline,
        metrics_port=args.metrics_port, log_level=args.log_level)
    configure_logging(settings.log_level)
    log.info("pdserve operator: watching %s, images %s (control plane), %s (engines) and %s "
             "(vLLM engines), store %s", settings.namespace or "every namespace", settings.image,
             settings.engine_image, settings.vllm_engine_image, settings.store_url)
    asyncio.run(serve(settings))
    return 0
