"""The Controller's state store: a small key/value interface with leases.

Two implementations share it: ``MemoryStore`` (local mode, one process, nothing
survives a restart) and ``EtcdStore`` (``etcd_store.py``: Kubernetes, two Controller
replicas). The Controller keeps its working state in memory and mirrors it here;
this interface is all it needs: leased keys (instance records, the leader key),
compare-and-create for the election, prefix reads for a new leader's load, and
fenced writes for the leader.

Fencing: a leader's term is named by the create revision of the leader key it
created (``Fence``). Every write the leader makes carries that fence, and the store
applies the write only if the leader key still has that create revision, in the
same atomic step (an etcd transaction). A key that expired, was deleted or was
created again by another replica has another revision (or none), so a write sent by
a replica that lost its leadership, however late it arrives, fails with
``FencedError`` and changes nothing.

Invariants: values are UTF-8 strings (JSON by convention); a key put under a
lease disappears when the lease expires or is revoked; ``create_if_absent`` and a
fenced ``put``/``delete`` are atomic; every method raises ``StoreError`` (never a
client-specific error) when the store cannot be reached, so callers handle one
exception type.
"""

from __future__ import annotations

import itertools
import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.controller.etcd_store import EtcdAccess


class StoreError(Exception):
    """The store could not be reached or refused the operation."""


class FencedError(StoreError):
    """A fenced write was refused: its writer no longer holds the key it was elected with."""


@dataclass(frozen=True)
class Fence:
    """The condition a leader's writes carry: ``key`` still has create revision ``revision``."""

    key: str
    revision: int


@dataclass(frozen=True)
class Entry:
    """A key's value with what the election compares: its create revision and lease (0: none)."""

    value: str
    create_revision: int
    lease: int


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
    async def put(self, key: str, value: str, lease: int | None = None, fence: Fence | None = None) -> None:
        """Write ``key``; with ``fence``, only while the fence holds (else ``FencedError``)."""

    @abstractmethod
    async def get(self, key: str) -> str | None: ...

    @abstractmethod
    async def get_entry(self, key: str) -> Entry | None: ...

    @abstractmethod
    async def get_prefix(self, prefix: str) -> dict[str, str]: ...

    @abstractmethod
    async def delete(self, key: str, fence: Fence | None = None) -> None:
        """Delete ``key`` (absent: no error); with ``fence``, as for ``put``."""

    @abstractmethod
    async def create_if_absent(self, key: str, value: str, lease: int | None = None) -> bool:
        """Atomically create ``key``; False (and no change) when it exists."""

    async def close(self) -> None:
        return None


class MemoryStore(Store):
    """In-process store for local mode; leases expire on the monotonic clock."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._data: dict[str, tuple[str, int | None, int]] = {}  # key -> (value, lease, create revision)
        self._leases: dict[int, tuple[float, float]] = {}  # id -> (ttl_s, expires_at)
        # No lease expires before this: a refresh only moves an expiry later, so it is
        # never late, and ``_expire`` scans the leases only once it has passed (each
        # refresh scanning all of them was O(leases^2) a keepalive round).
        self._next_expiry = math.inf
        self._ids = itertools.count(1)
        self._revisions = itertools.count(1)

    def _expire(self) -> None:
        now = self._clock()
        if now < self._next_expiry:
            return
        dead = {lid for lid, (_, exp) in self._leases.items() if exp <= now}
        for lid in dead:
            del self._leases[lid]
        if dead:
            self._data = {k: v for k, v in self._data.items() if v[1] not in dead}
        self._next_expiry = min((exp for _, exp in self._leases.values()), default=math.inf)

    def _check(self, fence: Fence | None) -> None:
        if fence is None:
            return
        held = self._data.get(fence.key)
        if held is None or held[2] != fence.revision:
            raise FencedError(f"{fence.key} is no longer at revision {fence.revision}")

    async def grant_lease(self, ttl_s: int) -> int:
        lease_id, expires = next(self._ids), self._clock() + ttl_s
        self._leases[lease_id] = (float(ttl_s), expires)
        self._next_expiry = min(self._next_expiry, expires)
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

    async def put(self, key: str, value: str, lease: int | None = None, fence: Fence | None = None) -> None:
        self._expire()
        self._check(fence)
        if lease is not None and lease not in self._leases:
            raise StoreError(f"lease {lease} not found")
        held = self._data.get(key)
        self._data[key] = (value, lease, held[2] if held else next(self._revisions))

    async def get(self, key: str) -> str | None:
        entry = await self.get_entry(key)
        return entry.value if entry else None

    async def get_entry(self, key: str) -> Entry | None:
        self._expire()
        item = self._data.get(key)
        return Entry(item[0], item[2], item[1] or 0) if item else None

    async def get_prefix(self, prefix: str) -> dict[str, str]:
        self._expire()
        return {k: v for k, (v, _, _) in sorted(self._data.items()) if k.startswith(prefix)}

    async def delete(self, key: str, fence: Fence | None = None) -> None:
        self._expire()
        self._check(fence)
        self._data.pop(key, None)

    async def create_if_absent(self, key: str, value: str, lease: int | None = None) -> bool:
        self._expire()
        if key in self._data:
            return False
        await self.put(key, value, lease)
        return True


def open_store(url: str, access: EtcdAccess | None = None) -> Store:
    """``memory://`` or ``etcd://HOST:PORT[,HOST:PORT...]`` -> a store; ``access`` is the
    etcd client's TLS files and user (``etcd_store.EtcdAccess``). Called by the Controller CLI."""
    if url in ("memory", "memory://"):
        return MemoryStore()
    if url.startswith("etcd://"):
        from pdserve.controller.etcd_store import EtcdAccess, EtcdStore

        return EtcdStore(parse_endpoints(url), access or EtcdAccess())
    raise ValueError(f"unknown store {url!r}: use memory:// or etcd://HOST:PORT[,HOST:PORT...]")


def parse_endpoints(url: str) -> list[str]:
    """``etcd://a:1,b,[::1]:3`` -> ``["a:1", "b:2379", "[::1]:3"]``: every endpoint, in order."""
    endpoints = []
    for part in url.removeprefix("etcd://").rstrip("/").split(","):
        part = part.strip()
        if part.startswith("["):  # an IPv6 address
            host, _, rest = part.partition("]")
            host, port = host + "]", rest.removeprefix(":")
        else:
            host, _, port = part.partition(":")
        endpoints.append(f"{host or '127.0.0.1'}:{int(port or 2379)}")
    return endpoints
