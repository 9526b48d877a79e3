"""``Store`` on etcd v3 through ``aetcd`` (asyncio gRPC client; see docs/etcd-client.md).

Owns one aetcd client. Every call has a deadline (``timeout_s``) so an etcd outage
turns into ``StoreError`` quickly instead of stalling the Controller's loops; the
gRPC channel reconnects on its own when etcd comes back, so there is no reconnect
logic here.
"""

from __future__ import annotations

import asyncio
import contextlib

import aetcd

from pdserve.controller.store import Store, StoreError


class EtcdStore(Store):
    def __init__(self, host: str, port: int, timeout_s: float = 2.0) -> None:
        self.address = f"{host}:{port}"
        self._timeout_s = timeout_s
        self._client = aetcd.Client(host=host, port=port, timeout=max(1, int(timeout_s)))

    async def _call(self, coro):
        try:
            return await asyncio.wait_for(coro, self._timeout_s)
        except Exception as exc:  # noqa: BLE001 - aetcd and grpc raise many types
            raise StoreError(f"etcd {self.address}: {type(exc).__name__}: {exc}") from exc

    async def grant_lease(self, ttl_s: int) -> int:
        return (await self._call(self._client.lease(int(ttl_s)))).id

    async def refresh_lease(self, lease_id: int) -> bool:
        reply = await self._call(self._client.refresh_lease(lease_id))
        return reply is not None and reply.TTL > 0

    async def revoke_lease(self, lease_id: int) -> None:
        try:
            await self._call(self._client.revoke_lease(lease_id))
        except StoreError as exc:
            if "not found" not in str(exc):
                raise

    async def put(self, key: str, value: str, lease: int | None = None) -> None:
        await self._call(self._client.put(key.encode(), value.encode(), lease=lease))

    async def get(self, key: str) -> str | None:
        item = await self._call(self._client.get(key.encode()))
        return item.value.decode() if item is not None else None

    async def get_prefix(self, prefix: str) -> dict[str, str]:
        items = await self._call(self._client.get_prefix(prefix.encode()))
        return {kv.key.decode(): kv.value.decode() for kv in items}

    async def delete(self, key: str) -> None:
        await self._call(self._client.delete(key.encode()))

    async def create_if_absent(self, key: str, value: str, lease: int | None = None) -> bool:
        txn = self._client.transactions
        ok, _ = await self._call(self._client.transaction(
            compare=[txn.version(key.encode()) == 0],
            success=[txn.put(key.encode(), value.encode(), lease=lease)],
            failure=[],
        ))
        return bool(ok)

    async def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a dead connection is not an error
            await asyncio.wait_for(self._client.close(), self._timeout_s)
