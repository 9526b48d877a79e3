"""Controller instance view: the Controller's ``WatchView`` stream feeds the registry.

Each ``ClusterView`` replaces the registry's view whole (routable instances, their
load, and the mode: "PD" or "FALLBACK"). The stream is re-opened with bounded
exponential backoff when it breaks; while it is down the last view stays, so
requests keep flowing to engines that still serve (legs that fail are retried).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.api.proto import controller_pb2 as cpb
from pdserve.api.proto import controller_pb2_grpc as cpb_grpc
from pdserve.api.security import SecuritySettings, create_channel

from .instances import Instance, InstanceRegistry

log = logging.getLogger(__name__)
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0


def instances_from_view(view: cpb.ClusterView) -> list[Instance]:
    out = []
    for iv in view.instances:
        out.append(Instance(
            instance_id=iv.instance_id, address=iv.engine_address, role=iv.role,
            kv_endpoint=iv.kv_endpoint, kv_compat_hash=iv.kv_compat_hash,
            healthy=iv.health == "READY", draining=iv.health == "DRAINING",
            num_running=iv.load.num_running, num_waiting=iv.load.num_waiting,
            num_kv_blocks_used=iv.load.num_kv_blocks_used,
            num_kv_blocks_free=iv.load.num_kv_blocks_free,
        ))
    return out


class ControllerWatcher:
    def __init__(self, registry: InstanceRegistry, address: str, coordinator_id: str,
                 security: SecuritySettings | None = None) -> None:
        self.registry = registry
        self.address = address
        self.coordinator_id = coordinator_id
        self.security = security or SecuritySettings.from_env()
        self.num_views = 0
        self._task: asyncio.Task | None = None
        self._first = asyncio.Event()

    async def start(self, first_view_timeout_s: float = 2.0) -> None:
        """Called by the app at startup; waits briefly for the first view."""
        self._task = asyncio.create_task(self._run(), name="controller-watch")
        try:
            await asyncio.wait_for(self._first.wait(), first_view_timeout_s)
        except TimeoutError:
            log.warning("no view from the Controller at %s yet", self.address)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            channel = create_channel(self.address, self.security)
            try:
                stub = cpb_grpc.ControllerStub(channel)
                request = cpb.WatchViewRequest(coordinator_id=self.coordinator_id,
                                               cluster_token=self.security.token or "")
                async for view in stub.WatchView(request, metadata=self.security.metadata()):
                    self.apply(view)
                    backoff = BACKOFF_MIN_S
            except grpc.aio.AioRpcError as exc:
                log.warning("Controller watch broke (%s); retrying in %.1fs", exc.code().name, backoff)
            finally:
                await channel.close()
            await asyncio.sleep(backoff)
            backoff = min(BACKOFF_MAX_S, backoff * 2)

    def apply(self, view: cpb.ClusterView) -> None:
        self.registry.replace(instances_from_view(view), view.mode or "PD", view.fallback_reason)
        self.num_views += 1
        self._first.set()
