"""Leader election on the store: one key under a lease, created atomically, and the
fence every write of the leader carries.

Each Controller replica holds a lease of ``ttl_s``, renews it every ``ttl_s / 3``
and tries to create ``/pdserve/<cluster>/leader`` under it; a replica leads while
the key holds its identity under its own lease. The term's ``Fence`` is the key's
create revision: the store applies a leader's write only while the key still has
it (``store.py``), so a replica that lost the key cannot write, however late its
write arrives. A leader that shuts down cleanly revokes its lease, so the
handover is immediate; one that dies stops renewing and its key expires after
``ttl_s``.

Step-down: a leader acts (answers as leader, sends commands, writes) only until
``LEAD_FRACTION * ttl_s`` after it *sent* the last renewal the store confirmed.
The store expires the lease no sooner than ``ttl_s`` after it *received* that
renewal, so a leader cut off from the store stops acting before its key can
expire and a standby can be elected: there is never an instant with two leaders
acting. ``is_leader`` reads the deadline itself, so it turns False on time even
while a store call hangs; a watchdog then runs the hand-back (``on_change(False)``).

States: standby -> (key created or found ours) -> leading -> (key not ours, lease
gone, a write refused by the fence, or the renewal deadline passed) -> standby.

Invariants: ``is_leader`` is True only between ``on_change(True)`` having
completed and the deadline; transitions are serialized (one lock), and
``on_change(True)`` failing leaves the replica a standby that tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from pdserve.controller.store import Fence, FencedError, Store, StoreError

log = logging.getLogger(__name__)

LEAD_FRACTION = 0.9
"""Of the lease TTL, the part after a confirmed renewal during which a leader acts.
The rest is the margin for clock rates and for the renewal's trip to the store."""


class Election:
    def __init__(self, store: Store, key: str, identity: str, ttl_s: int, on_change,
                 clock=time.monotonic) -> None:
        """``on_change(is_leader)`` is awaited on every change of leadership."""
        self.store, self.key, self.identity, self.ttl_s = store, key, identity, ttl_s
        self.clock = clock
        self.leader = ""
        self.fence: Fence | None = None      # this replica's term, while it has one
        self._lease: int | None = None
        self._lead_until_s = float("-inf")   # the clock time the term's acting ends, unless renewed
        self._on_change = on_change
        self._transition = asyncio.Lock()
        self.is_store_ok = True

    @property
    def is_leader(self) -> bool:
        return self.fence is not None and self.clock() < self._lead_until_s

    def write_fence(self) -> Fence:
        """The fence for a write of this term. Called by the persister before every
        write; raises ``FencedError`` when this replica does not lead (now)."""
        fence = self.fence
        if fence is None or not self.is_leader:
            raise FencedError(f"{self.identity} does not lead")
        return fence

    async def run(self) -> None:
        """The election loop and its watchdog; the Controller runs it as a task for its lifetime."""
        await asyncio.gather(self._campaign(), self._watchdog())

    async def _campaign(self) -> None:
        while True:
            try:
                await self.step()
                self.is_store_ok = True
            except StoreError as exc:
                if self.is_store_ok:
                    log.warning("election: store unreachable: %s", exc)
                self.is_store_ok = False
            await asyncio.sleep(self.ttl_s / 3)

    async def _watchdog(self) -> None:
        """Steps down when the renewal deadline passes, even while ``step`` waits on the store."""
        while True:
            if self.fence is not None and self.clock() >= self._lead_until_s:
                await self.step_down("its lease was not renewed in time")
            left_s = self._lead_until_s - self.clock() if self.fence is not None else self.ttl_s / 3
            await asyncio.sleep(min(max(left_s, 0.01), self.ttl_s / 3))

    async def step(self) -> None:
        """Renew the lease, try to take the key, and follow who holds it. Called by the
        loop every ``ttl_s / 3`` (tests call it directly)."""
        if self.fence is not None and self.clock() >= self._lead_until_s:
            await self.step_down("its lease was not renewed in time")
        sent_s = self.clock()
        if self._lease is not None and not await self.store.refresh_lease(self._lease):
            self._lease = None  # expired in the store, and the key with it
            await self.step_down("its lease expired in the store")
        if self._lease is None:
            self._lease = await self.store.grant_lease(self.ttl_s)
        self._lead_until_s = sent_s + LEAD_FRACTION * self.ttl_s
        if self.fence is None:
            await self.store.create_if_absent(self.key, self.identity, self._lease)
        # Read back rather than trust the create's answer: a create whose reply was
        # lost may have succeeded, and the key is ours exactly when it has our lease.
        entry = await self.store.get_entry(self.key)
        self.leader = entry.value if entry is not None else ""
        is_ours = entry is not None and entry.value == self.identity and entry.lease == self._lease
        if is_ours and self.fence is None:
            await self._take(Fence(self.key, entry.create_revision))
        elif not is_ours and self.fence is not None:
            await self.step_down(f"the key is held by {self.leader or 'no one'}")

    async def _take(self, fence: Fence) -> None:
        async with self._transition:
            if self.fence is not None or self.clock() >= self._lead_until_s:
                return
            await self._on_change(True)  # loads the last leader's state; may raise: still a standby
            self.fence, self.leader = fence, self.identity
            log.warning("%s took leadership (term %d, %s)", self.identity, fence.revision,
                        time.strftime("%H:%M:%S"))

    async def step_down(self, why: str) -> None:
        """Stop leading now. Called by the loop, the watchdog, and the Controller when
        the store refused a write of this term (``FencedError``)."""
        async with self._transition:
            if self.fence is None:
                return
            revision, self.fence = self.fence.revision, None
            log.warning("%s lost leadership (term %d): %s (%s)", self.identity, revision, why,
                        time.strftime("%H:%M:%S"))
            await self._on_change(False)

    async def resign(self) -> None:
        """Called on clean shutdown: revoke the lease so a standby leads at once."""
        self.fence = None
        if self._lease is not None:
            with contextlib.suppress(StoreError):
                await self.store.revoke_lease(self._lease)
        self._lease = None
