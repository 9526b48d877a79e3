"""KV transports behind one interface (base.Transport) and the factory that picks one."""

from __future__ import annotations

from pdserve.engine.kv_transfer.transport.base import (
    BatchHandle,
    Items,
    TransferItem,
    TransferState,
    TransferStatus,
    Transport,
)

TRANSPORT_NAMES = ("tcp", "shm", "mooncake", "nixl")


def create_transport(name: str, **options) -> Transport:
    """Build the transport the PDCluster spec names; called once by the engine's worker.

    Options are the transport's keyword arguments (host, port, auth_token, timeout_s...).
    Modules are imported here so a node without Mooncake or NIXL can still use tcp or shm.
    """
    if name == "tcp":
        from pdserve.engine.kv_transfer.transport.tcp import TcpTransport

        return TcpTransport(**options)
    if name == "shm":
        from pdserve.engine.kv_transfer.transport.shm import ShmTransport

        return ShmTransport(**options)
    if name == "mooncake":
        from pdserve.engine.kv_transfer.transport.mooncake import MooncakeTransport

        return MooncakeTransport(**options)
    if name == "nixl":
        from pdserve.engine.kv_transfer.transport.nixl import NixlTransport

        return NixlTransport(**options)
    raise ValueError(f"unknown KV transport {name!r}; expected one of {TRANSPORT_NAMES}")


__all__ = [
    "TRANSPORT_NAMES",
    "BatchHandle",
    "Items",
    "TransferItem",
    "TransferState",
    "TransferStatus",
    "Transport",
    "create_transport",
]
