"""Leader election on the store: one key under a lease, created atomically.

Each Controller replica holds a lease of ``ttl_s`` and tries to create
``/pdserve/<cluster>/leader`` under it every ``ttl_s / 3``; whoever creates it leads
while it keeps the lease alive. A leader that dies stops refreshing, the key
expires after at most ``ttl_s``, and a standby's next attempt wins. A leader that
shuts down cleanly revokes its lease, so the handover is immediate.

Invariants: ``is_leader`` becomes True only after the key was created with this
replica's identity, and False as soon as a refresh finds the lease gone or the key
held by someone else. During a store outage the leader keeps leading (no one else
can be elected without the store either) and retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from pdserve.controller.store import Store, StoreError

log = logging.getLogger(__name__)


class Election:
    def __init__(self, store: Store, key: str, identity: str, ttl_s: int, on_change) -> None:
        """``on_change(is_leader)`` is awaited on every change of leadership."""
        self.store, self.key, self.identity, self.ttl_s = store, key, identity, ttl_s
        self.is_leader = False
        self.leader = ""
        self._lease: int | None = None
        self._on_change = on_change
        self.is_store_ok = True

    async def run(self) -> None:
        """The election loop; the Controller runs it as a task for its lifetime."""
        while True:
            try:
                await self.step()
                self.is_store_ok = True
            except StoreError as exc:
                if self.is_store_ok:
                    log.warning("election: store unreachable: %s", exc)
                self.is_store_ok = False
            await asyncio.sleep(self.ttl_s / 3)

    async def step(self) -> None:
        if self._lease is not None and not await self.store.refresh_lease(self._lease):
            self._lease = None
        if self._lease is None:
            self._lease = await self.store.grant_lease(self.ttl_s)
        if not self.is_leader and await self.store.create_if_absent(self.key, self.identity, self._lease):
            self.leader = self.identity
            await self._set(True)
            return
        holder = await self.store.get(self.key) or ""
        self.leader = holder
        if self.is_leader and holder != self.identity:
            await self._set(False)

    async def _set(self, is_leader: bool) -> None:
        self.is_leader = is_leader
        log.warning("%s %s leadership (%s)", self.identity, "took" if is_leader else "lost",
                    time.strftime("%H:%M:%S"))
        await self._on_change(is_leader)

    async def resign(self) -> None:
        """Called on clean shutdown: revoke the lease so a standby leads at once."""
        if self._lease is not None:
            with contextlib.suppress(StoreError):
                await self.store.revoke_lease(self._lease)
        self._lease = None
        self.is_leader = False
