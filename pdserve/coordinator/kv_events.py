"""``KVEventFeeds``: one ``KVEvents`` stream per engine of the view, into the prefix index.

Started by the app's lifespan beside the view source. Whenever the view changes,
each engine in it gets a feed task and each engine that left loses its task and its
index entry (its cache is nobody's to route to). A feed resumes its stream where it
left off (same epoch and sequence number) after a broken connection, with
back-off; the engine answers with the events since or, after its restart or when
they are no longer kept, a snapshot that replaces what the index knew. An engine
that does not implement ``KVEvents`` keeps the index's routed estimate
(``prefix_index.py``), and its feed stops.
"""

from __future__ import annotations

import asyncio
import logging

from .engine_errors import EngineCallError, Unsupported
from .instances import InstanceRegistry
from .metrics import CoordinatorMetrics
from .prefix_index import PrefixIndex

log = logging.getLogger(__name__)

RETRY_MIN_S, RETRY_MAX_S = 0.2, 5.0


class KVEventFeeds:
    def __init__(self, registry: InstanceRegistry, index: PrefixIndex,
                 metrics: CoordinatorMetrics, block_size: int) -> None:
        """``block_size``: the Coordinator's, which its prompt hashes are chained by; an
        engine with another block size cannot be matched, and its events are not applied."""
        self.registry, self.index, self.metrics = registry, index, metrics
        self.block_size = block_size
        self._feeds: dict[str, tuple[str, asyncio.Task]] = {}  # instance id -> (address, task)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self.sync()
        self._task = asyncio.create_task(self._follow_view(), name="kv-event-feeds")

    async def stop(self) -> None:
        tasks = [t for _, t in self._feeds.values()] + ([self._task] if self._task else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._feeds.clear()

    async def _follow_view(self) -> None:
        while True:
            await self.registry.wait_changed(60.0)
            self.sync()

    def sync(self) -> None:
        """Feeds for exactly the view's engines (an engine at a new address: a new feed)."""
        wanted = {i.instance_id: i.address for i in self.registry.all() if i.address}
        for iid, (address, task) in list(self._feeds.items()):
            if wanted.get(iid) != address:
                task.cancel()
                del self._feeds[iid]
                self.index.forget(iid)
        for iid, address in wanted.items():
            if iid not in self._feeds:
                task = asyncio.create_task(self._feed(iid, address), name=f"kv-events {iid}")
                self._feeds[iid] = (address, task)

    async def _feed(self, instance_id: str, address: str) -> None:
        epoch, seq, retry_s = "", 0, RETRY_MIN_S
        while True:
            streaming = False
            try:
                async for batch in self.registry.engine(address).kv_events(epoch, seq, self.block_size):
                    if batch.block_size != self.block_size:
                        log.warning("engine %s caches %d-token blocks, this Coordinator hashes "
                                    "prompts by %d (--block-size): its prefix cache cannot be "
                                    "matched", address, batch.block_size, self.block_size)
                        return
                    if not streaming:
                        streaming, retry_s = True, RETRY_MIN_S
                        self.metrics.kv_event_streams.inc()
                    self.index.apply(instance_id, batch.snapshot, batch.stored, batch.removed)
                    epoch, seq = batch.epoch, batch.seq
            except Unsupported:
                log.info("engine %s publishes no KV events: routing on routed prefixes", address)
                return
            except EngineCallError as exc:
                log.debug("KV events of %s: %s", address, exc.status)
            finally:
                if streaming:
                    self.metrics.kv_event_streams.dec()
            await asyncio.sleep(retry_s)
            retry_s = min(RETRY_MAX_S, retry_s * 2)
