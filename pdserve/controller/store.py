"""The Controller's state store: a small key/value interface with leases.

Two implementations share it: ``MemoryStore`` (local mode, one process, nothing
survives a restart) and ``EtcdStore`` (``etcd_store.py``: Kubernetes, two Controller
replicas). The Controller keeps its working state in memory and mirrors it here;
this interface is all it needs: leased keys (instance records, the leader key),
compare-and-create for the election, prefix reads for a new leader's load.

Invariants: values are UTF-8 strings (JSON by convention); a key put under a
lease disappears when the lease expires or is revoked; ``create_if_absent`` is
atomic; every method raises ``StoreError`` (never a client-specific error) when
the store cannot be reached, so callers handle one exception type.
"""

from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod


class StoreError(Exception):
    """The store could not be reached or refused the operation."""


class Store(ABC):
    """Async key/value store with leases. Called by the Controller's loops only."""

    @abstractmethod
    async def grant_lease(self, ttl_s: int) -> int: ...

    @abstractmethod
    async def refresh_lease(self, lease_id: int) -> bool:
        """Keep a lease alive; False when it has already expired (keys are gone)."""

    @abstractmethod
    async def revoke_lease(self, lease_id: int) -> None: ...

    @abstractmethod
    async def put(self, key: str, value: str, lease: int | None = None) -> None: ...

    @abstractmethod
    async def get(self, key: str) -> str | None: ...

    @abstractmethod
    async def get_prefix(self, prefix: str) -> dict[str, str]: ...

    @abstractmethod
    async def delete(self, key: str) -> None: ...

    @abstractmethod
    async def create_if_absent(self, key: str, value: str, lease: int | None = None) -> bool:
        """Atomically create ``key``; False (and no change) when it exists."""

    async def close(self) -> None:
        return None


class MemoryStore(Store):
    """In-process store for local mode; leases expire on the monotonic clock."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._data: dict[str, tuple[str, int | None]] = {}
        self._leases: dict[int, tuple[float, float]] = {}  # id -> (ttl_s, expires_at)
        self._ids = itertools.count(1)

    def _expire(self) -> None:
        now = self._clock()
        dead = {lid for lid, (_, exp) in self._leases.items() if exp <= now}
        for lid in dead:
            del self._leases[lid]
        if dead:
            self._data = {k: v for k, v in self._data.items() if v[1] not in dead}

    async def grant_lease(self, ttl_s: int) -> int:
        lease_id = next(self._ids)
        self._leases[lease_id] = (float(ttl_s), self._clock() + ttl_s)
        return lease_id

    async def refresh_lease(self, lease_id: int) -> bool:
        self._expire()
        if lease_id not in self._leases:
            return False
        ttl = self._leases[lease_id][0]
        self._leases[lease_id] = (ttl, self._clock() + ttl)
        return True

    async def revoke_lease(self, lease_id: int) -> None:
        self._leases.pop(lease_id, None)
        self._data = {k: v for k, v in self._data.items() if v[1] != lease_id}

    async def put(self, key: str, value: str, lease: int | None = None) -> None:
        self._expire()
        if lease is not None and lease not in self._leases:
            raise StoreError(f"lease {lease} not found")
        self._data[key] = (value, lease)

    async def get(self, key: str) -> str | None:
        self._expire()
        item = self._data.get(key)
        return item[0] if item else None

    async def get_prefix(self, prefix: str) -> dict[str, str]:
        self._expire()
        return {k: v for k, (v, _) in sorted(self._data.items()) if k.startswith(prefix)}

    async def delete(self, key: str) -> None:
        self._data.pop(key, None)

    async def create_if_absent(self, key: str, value: str, lease: int | None = None) -> bool:
        self._expire()
        if key in self._data:
            return False
        await self.put(key, value, lease)
        return True


def open_store(url: str) -> Store:
    """``memory://`` or ``etcd://HOST:PORT`` -> a store. Called by the Controller CLI."""
    if url in ("memory", "memory://"):
        return MemoryStore()
    if url.startswith("etcd://"):
        from pdserve.controller.etcd_store import EtcdStore

        host, _, port = url.removeprefix("etcd://").rstrip("/").partition(":")
        return EtcdStore(host or "127.0.0.1", int(port or 2379))
    raise ValueError(f"unknown store {url!r}: use memory:// or etcd://HOST:PORT")
