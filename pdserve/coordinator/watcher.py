"""Controller instance view: the Controller's ``WatchView`` stream feeds the registry.

Each ``ClusterView`` replaces the registry's view whole (routable instances, their
load, the mode: "PD" or "FALLBACK", and the pair checks the Controller publishes:
``instances.PublishedPairs``, which the Coordinator routes on instead of probing). ``address`` may name several Controller
replicas (``A,B``), as the NodeAgent's ``--controller`` does: a replica that answers
FAILED_PRECONDITION (a standby), cannot be reached, or whose stream breaks or
stays silent for ``SILENT_AFTER_S`` (the leader died) makes the watcher try the next one at once; only after every
replica failed in a row does it wait, with bounded exponential backoff. While no
stream is open the last view stays, so requests keep flowing to engines that
still serve (legs that fail are retried).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.api.proto import controller_pb2 as cpb
from pdserve.api.proto import controller_pb2_grpc as cpb_grpc
from pdserve.runtime.security import SecuritySettings, create_channel

from .instances import InstanceRegistry, PublishedPairs

log = logging.getLogger(__name__)
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 1.0  # a handover takes a few seconds: look again at least every second
SILENT_AFTER_S = 5.0  # the leader sends the view at least every second; a silent stream is dead


def views_from_view(view: cpb.ClusterView):
    """Each routable instance as ``InstanceRegistry.apply_view`` takes it: its id and its
    ``VIEW_FIELDS`` values in that order, read straight from the message (no object is
    built for an instance the registry holds: a thousand of them were most of a view's
    30 ms). ``block_size`` is not in the view (0)."""
    for iv in view.instances:
        load, health = iv.load, iv.health
        yield iv.instance_id, (
            iv.engine_address, iv.role, iv.kv_endpoint, iv.kv_compat_hash, health == "READY",
            health == "DRAINING", load.num_running, load.num_waiting, load.num_kv_blocks_used,
            load.num_kv_blocks_free, 0, iv.max_model_len, iv.peers_checked_version,
            iv.peers_listed_version), None


def pairs_from_view(view: cpb.ClusterView) -> PublishedPairs | None:
    """The Controller's pair checks, or None when the view carries none (the
    Coordinator's own ``PairChecks`` then probe every pair)."""
    if not view.publishes_pairs:
        return None
    return PublishedPairs({(u.prefill_id, u.decode_id): u.reason or "unreachable" for u in view.unusable_pairs})


class ControllerWatcher:
    def __init__(self, registry: InstanceRegistry, address: str, coordinator_id: str,
                 security: SecuritySettings | None = None) -> None:
        """``address``: ``HOST:PORT`` of the Controller, or comma-separated replicas."""
        self.registry = registry
        self.address = address
        self.addresses = tuple(a.strip() for a in address.split(",") if a.strip())
        if not self.addresses:
            raise ValueError(f"no Controller address in {address!r}")
        self._index = 0
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

    @property
    def current_address(self) -> str:
        """The replica the watch is (or will next be) open on."""
        return self.addresses[self._index]

    async def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        num_failed = 0  # replicas in a row that gave no view
        while True:
            address = self.current_address
            if await self._watch(address):
                backoff, num_failed = BACKOFF_MIN_S, 0
            else:
                num_failed += 1
            self._index = (self._index + 1) % len(self.addresses)
            if num_failed >= len(self.addresses):
                log.warning("no Controller replica serves the view (%s); retrying in %.1fs",
                            ",".join(self.addresses), backoff)
                await asyncio.sleep(backoff)
                backoff, num_failed = min(BACKOFF_MAX_S, backoff * 2), 0

    async def _watch(self, address: str) -> bool:
        """One watch on ``address`` until it ends; True when it delivered a view."""
        num_views = self.num_views
        channel = create_channel(address, self.security)
        try:
            stub = cpb_grpc.ControllerStub(channel)
            request = cpb.WatchViewRequest(coordinator_id=self.coordinator_id,
                                           cluster_token=self.security.token or "")
            call = stub.WatchView(request, metadata=self.security.metadata())
            while (view := await asyncio.wait_for(call.read(), SILENT_AFTER_S)) is not grpc.aio.EOF:
                self.apply(view)
        except TimeoutError:
            log.warning("Controller watch on %s silent for %.0fs; trying the next replica",
                        address, SILENT_AFTER_S)
        except grpc.aio.AioRpcError as exc:
            is_standby = exc.code() == grpc.StatusCode.FAILED_PRECONDITION
            log.log(logging.INFO if is_standby else logging.WARNING, "Controller watch on %s: %s %s",
                    address, exc.code().name, exc.details())
        finally:
            await channel.close()
        return self.num_views > num_views

    def apply(self, view: cpb.ClusterView) -> None:
        self.registry.apply_view(views_from_view(view), view.mode or "PD", view.fallback_reason,
                                 list(view.recent_events), pairs_from_view(view))
        self.num_views += 1
        self._first.set()
