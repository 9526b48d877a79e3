"""The operator's client of each cluster's Controller (gRPC, ``pdserve.api`` protos).

Owns one channel per Controller address and the calls the operator makes:
``drain`` (before deleting a scaled-down instance), ``list_replacements`` /
``ack_replacement`` (instances the Controller wants recreated), ``view`` (mode, and
the routable instances' role and last heartbeat, for the PDCluster and PDInstance
status; their engine addresses, for the doctor's checks; the SLO planner's last
decision, whose pool sizes the PDCluster follows) and ``forget`` (on PDCluster
deletion: nothing of the cluster stays in the store). Each call presents the
cluster's own token (``tokens.py``); TLS material, when configured, is the
operator's own (its environment).

Invariants: every call has a deadline, and ends by it even if grpc's own end of it
never reaches the loop; every failure (unreachable, standby,
refused) raises ``ControllerUnavailable``, which reconcile treats as "not now":
it never blocks the rest of a reconcile on the Controller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pdserve.api.proto import controller_pb2 as pb
from pdserve.api.proto import controller_pb2_grpc as pb_grpc
from pdserve.runtime.security import TOKEN_METADATA_KEY, SecuritySettings, create_channel

CALL_TIMEOUT_S = 5.0
CALL_GUARD_S = 2.0  # a call's end overdue by this much past its deadline is taken as lost


class ControllerUnavailable(Exception):
    """The Controller could not answer (not running yet, no leader, refused)."""


@dataclass(frozen=True)
class DrainState:
    is_drained: bool
    num_running: int = 0
    num_waiting: int = 0


@dataclass(frozen=True)
class RoutableInstance:
    """An instance in the Controller's routable view (its health is READY)."""

    role: str
    last_heartbeat_unix_s: float


@dataclass(frozen=True)
class ControllerView:
    mode: str  # PD | FALLBACK | COLOCATED
    routable: dict[str, RoutableInstance] = field(default_factory=dict)
    instances: tuple[pb.InstanceView, ...] = ()  # as sent: engine addresses etc., for the doctor
    planner: pb.PlannerView | None = None  # None while the Controller runs no planner


class ControllerClient:
    """Calls to one cluster's Controller. Built by ``ControllerClients.for_cluster``."""

    def __init__(self, stub: pb_grpc.ControllerStub, metadata: tuple, address: str) -> None:
        self._stub, self._metadata, self.address = stub, metadata, address

    async def _call(self, method: str, request):
        # grpc's deadline ends the call; the loop's own bound answers should that end
        # never reach this loop (a delete handler waiting on ForgetCluster holds the
        # PDCluster's finalizer for as long as it waits)
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S + CALL_GUARD_S):
                return await getattr(self._stub, method)(request, timeout=CALL_TIMEOUT_S,
                                                         metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise ControllerUnavailable(
                f"{method} on {self.address}: {exc.code().name} {exc.details()}") from exc
        except TimeoutError:
            raise ControllerUnavailable(
                f"{method} on {self.address}: no end {CALL_TIMEOUT_S + CALL_GUARD_S:g} s after it was sent") from None

    async def drain(self, instance_id: str, deadline_s: float) -> DrainState:
        reply = await self._call("Drain", pb.DrainRequest(instance_id=instance_id,
                                                          deadline_s=deadline_s))
        return DrainState(reply.is_drained, reply.num_running, reply.num_waiting)

    async def list_replacements(self) -> dict[str, str]:
        """Instance id -> reason, for every outstanding replacement request."""
        reply = await self._call("ListReplacements", pb.ListReplacementsRequest())
        return {r.instance_id: r.reason for r in reply.replacements}

    async def ack_replacement(self, instance_id: str) -> None:
        await self._call("AckReplacement", pb.AckReplacementRequest(instance_id=instance_id))

    async def forget(self) -> int:
        return (await self._call("ForgetCluster", pb.ForgetClusterRequest())).num_keys_deleted

    async def view(self) -> ControllerView:
        """The mode, the routable instances (the view lists READY ones only) and the
        planner's last decision."""
        reply = await self._call("GetView", pb.WatchViewRequest(coordinator_id="operator"))
        return ControllerView(reply.mode, {
            i.instance_id: RoutableInstance(i.role, i.last_heartbeat_unix_s) for i in reply.instances},
            tuple(reply.instances), reply.planner if reply.HasField("planner") else None)


class ControllerClients:
    """Channels by address, shared by all reconciles. Closed by the operator on exit."""

    def __init__(self, address_template: str, security: SecuritySettings | None = None,
                 port: int = 50050,
                 channel_factory: Callable[[str], grpc.aio.Channel] | None = None) -> None:
        self._template, self._port = address_template, port
        self._security = security or SecuritySettings()
        self._factory = channel_factory or (lambda a: create_channel(a, self._security))
        self._channels: dict[str, grpc.aio.Channel] = {}

    def for_cluster(self, name: str, namespace: str, token: str | None = None) -> ControllerClient:
        """The client of cluster ``namespace/name``'s Controller, presenting ``token``
        (the cluster's; default: the operator's own, from its environment)."""
        address = self._template.format(cluster=name, namespace=namespace, port=self._port)
        if address not in self._channels:
            self._channels[address] = self._factory(address)
        stub = pb_grpc.ControllerStub(self._channels[address])
        metadata = ((TOKEN_METADATA_KEY, token),) if token else self._security.metadata()
        return ControllerClient(stub, metadata, address)

    async def close_cluster(self, name: str, namespace: str) -> None:
        """Called once a PDCluster is finalized: its Controller is going away."""
        address = self._template.format(cluster=name, namespace=namespace, port=self._port)
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
