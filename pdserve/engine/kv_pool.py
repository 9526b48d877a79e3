"""A KV pool shared by engines, on Mooncake Store: prefix blocks by content hash.

MindIE Motor's P → pool → D, and more: every engine of a cluster puts each full
prompt block it computes (or receives) into the pool under its block hash (chained
as ``runtime/block_hash.py``, prefixed by the model and KV layout, so only engines
whose bytes mean the same thing share keys), and an engine whose own prefix cache
misses the start of a prompt fetches the blocks the pool has instead of computing
them again: a prompt computed on one prefill engine is a cache hit on every other.

Where it sits: ``BlockManager.find_cached_blocks`` asks ``PoolCache.fill`` for the
blocks after its own hits; ``fill`` looks them up (one batched existence check),
takes free blocks for the run the pool has, copies their bytes into the KV cache
and registers them as cached blocks, so the request takes them as ordinary hits.
``BlockManager.cache_full_blocks`` tells ``stored`` of each newly cached block; its
bytes are copied out at once (the block may be reused right after) and put by a
background thread, at most ``MAX_PENDING_PUTS`` waiting (more are dropped, and
counted). Called on the engine loop thread (or the KV connector's, for D).

A pool that fails or evicts is a cache miss, never a request error: a failed
lookup or fetch leaves the blocks to be computed, a failed put is counted. A pool
whose master stops answering is *down*: the Mooncake client then takes seconds per
call while it reconnects (and has crashed in calls made in that state), so no call
is made until a TCP connect to the master succeeds again (checked every
``RECHECK_S`` by the put thread) and one lookup answers.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.runtime.queues import items_until_none

log = logging.getLogger(__name__)

MAX_PENDING_PUTS = 4096
RECHECK_S = 2.0
JOIN_WAIT_S = 30.0  # at start, for a master that is not listening yet
RPC_FAILED = -900  # Mooncake's error code for a call the master did not answer


@dataclass
class PoolStats:
    """Read by the engine's metrics; written by the loop thread and the put thread."""

    num_lookups: int = 0        # blocks looked up after a local miss
    num_hits: int = 0           # blocks fetched from the pool into the local cache
    num_puts: int = 0           # blocks put
    num_put_failures: int = 0
    num_put_drops: int = 0      # not put: too many waiting
    num_fetch_failures: int = 0
    bytes_fetched: int = 0
    bytes_put: int = 0
    num_down: int = 0           # times the pool was found down


class PoolCache:
    def __init__(self, store, kv_cache: torch.Tensor, key_prefix: str, master: str = "") -> None:
        """``store``: a set-up ``MooncakeDistributedStore`` (``connect``); ``kv_cache``:
        ``[layers, 2, blocks, block_size, kv_heads, head_dim]``, on the CPU; ``master``:
        host:port, checked while the pool is down."""
        self.store = store
        self.master = master
        self.is_up = True
        self.kv_cache = kv_cache
        self.prefix = key_prefix
        one = kv_cache[:, :, 0]
        self.block_bytes = one.numel() * one.element_size()
        self.stats = PoolStats()
        self._known: set[bytes] = set()  # hashes put or fetched by this engine (no re-put)
        self._puts: queue.Queue = queue.Queue(MAX_PENDING_PUTS)
        self._thread = threading.Thread(target=self._put_loop, name="kv-pool-put", daemon=True)
        self._thread.start()

    def stats_fields(self) -> dict:
        """The ``StatsResponse`` fields of the pool (``LLMEngine.stats``)."""
        s = self.stats
        return {"kv_pool_enabled": True, "kv_pool_up": self.is_up,
                "kv_pool_lookup_blocks": s.num_lookups, "kv_pool_hit_blocks": s.num_hits,
                "kv_pool_put_blocks": s.num_puts, "kv_pool_fetched_bytes": s.bytes_fetched,
                "kv_pool_put_bytes": s.bytes_put,
                "kv_pool_put_dropped": s.num_put_drops + s.num_put_failures}

    def key(self, block_hash: bytes) -> str:
        return f"{self.prefix}/{block_hash.hex()}"

    # -- fetch (the engine loop) -----------------------------------------------------

    def fill(self, block_manager, hashes: list[bytes], keep: set[int]) -> None:
        """Called by ``find_cached_blocks`` with the chain after its local hits: makes the
        leading run of ``hashes`` the pool has into cached blocks of ``block_manager``,
        never evicting the blocks in ``keep`` (the local hits)."""
        if not hashes or not self.is_up:
            return
        self.stats.num_lookups += len(hashes)
        try:
            present = self.store.batch_is_exist([self.key(h) for h in hashes])
        except Exception as exc:  # noqa: BLE001 - a pool failure is a cache miss
            present = [RPC_FAILED]
            log.debug("KV pool lookup failed: %s", exc)
        if RPC_FAILED in present:
            self._went_down("lookup")
            return
        n = next((i for i, p in enumerate(present) if p != 1), len(hashes))
        blocks = block_manager.take_blocks_for_fill(n, keep)
        if not blocks:
            return
        n = len(blocks)
        staging = torch.empty((n, *self.kv_cache[:, :, 0].shape), dtype=self.kv_cache.dtype)
        flat = staging.view(torch.uint8).numpy().reshape(n, self.block_bytes)
        try:
            got = self.store.batch_get_into([self.key(h) for h in hashes[:n]],
                                            [flat[i].ctypes.data for i in range(n)],
                                            [self.block_bytes] * n)
        except Exception as exc:  # noqa: BLE001 - as above
            got = [-1] * n
            log.debug("KV pool fetch failed: %s", exc)
        n_ok = next((i for i, g in enumerate(got) if g != self.block_bytes), n)
        if n_ok < n:
            self._fetch_failed(f"{n - n_ok} of {n} blocks not fetched (evicted?)")
        if n_ok:
            ids = torch.tensor(blocks[:n_ok])
            self.kv_cache[:, :, ids] = staging[:n_ok].permute(1, 2, 0, 3, 4, 5)
            self.stats.num_hits += n_ok
            self.stats.bytes_fetched += n_ok * self.block_bytes
            self._known.update(hashes[:n_ok])
        block_manager.finish_fill(blocks, hashes[:n_ok])

    def _fetch_failed(self, why: str) -> None:
        self.stats.num_fetch_failures += 1
        log.debug("KV pool: %s; computing instead", why)

    def _went_down(self, what: str) -> None:
        if self.is_up:
            self.is_up = False
            self.stats.num_down += 1
            self.stats.num_fetch_failures += what == "lookup"
            log.warning("KV pool at %s does not answer (%s): prefixes are computed until "
                        "it is back", self.master or "?", what)

    def _check(self) -> None:
        """The put thread, when idle for ``RECHECK_S``: down as soon as the master stops
        accepting connections (before a request's lookup finds out slowly); back once it
        accepts them and answers a lookup. Without a master address, nothing to check."""
        if not self.master:
            return
        if self.is_up:
            if not _reachable(self.master):
                self._went_down("no connection")
            return
        if not _reachable(self.master):
            return
        try:
            answer = self.store.batch_is_exist([f"{self.prefix}/probe"])
        except Exception:  # noqa: BLE001 - still down
            return
        if RPC_FAILED not in answer:
            self.is_up = True
            log.info("KV pool at %s answers again", self.master)

    # -- put (copied on the engine loop, put by a thread) ----------------------------

    def stored(self, block_hash: bytes, block_id: int) -> None:
        """Called by ``cache_full_blocks`` for each newly cached block."""
        if block_hash in self._known or not self.is_up:
            return
        self._known.add(block_hash)
        data = self.kv_cache[:, :, block_id].contiguous()  # the block may be reused next step
        try:
            self._puts.put_nowait((block_hash, data))
        except queue.Full:
            self.stats.num_put_drops += 1
            self._known.discard(block_hash)

    def _put_loop(self) -> None:
        for block_hash, data in items_until_none(self._puts, RECHECK_S, self._check):
            if not self.is_up:  # dropped: no call while the pool is down
                self.stats.num_put_drops += 1
                self._known.discard(block_hash)
                self._puts.task_done()
                continue
            raw = data.view(torch.uint8).numpy()
            try:
                rc = self.store.put(self.key(block_hash), np.ascontiguousarray(raw).tobytes())
            except Exception as exc:  # noqa: BLE001 - counted, never fatal
                rc = exc
            if rc == RPC_FAILED:
                self._went_down("put")
            if rc == 0:
                self.stats.num_puts += 1
                self.stats.bytes_put += self.block_bytes
            else:
                self.stats.num_put_failures += 1
                self._known.discard(block_hash)
                log.debug("KV pool put failed: %s", rc)
            self._puts.task_done()

    def flush(self, timeout_s: float = 10.0) -> None:
        """Waits (at most ``timeout_s``) until every queued put is done: tests, benchmarks."""
        deadline = time.monotonic() + timeout_s
        while self._puts.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        """Stops the put thread and leaves the pool (its blocks in this engine's segment
        go with it); a client of a pool that is down is dropped, not closed (that call
        waits for the master)."""
        self._puts.put(None)
        self._thread.join(5)
        if self.is_up:
            closer = threading.Thread(target=self._close_store, daemon=True)
            closer.start()
            closer.join(5)

    def _close_store(self) -> None:
        try:
            self.store.close()
        except Exception as exc:  # noqa: BLE001 - closing anyway
            log.debug("closing the KV pool client: %s", exc)


def _reachable(master: str) -> bool:
    host, _, port = master.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except (OSError, ValueError):
        return False
    return True


def connect(master: str, local_host: str, segment_bytes: int):
    """A Mooncake Store client of the pool at ``master`` (host:port of mooncake_master),
    contributing ``segment_bytes`` of this process's memory to it (TCP protocol). Waits
    up to ``JOIN_WAIT_S`` for the master to listen (its Pod or process may start after
    the engine's)."""
    from mooncake.store import MooncakeDistributedStore

    deadline = time.monotonic() + JOIN_WAIT_S  # a master starting beside the engines
    while not _reachable(master):
        if time.monotonic() >= deadline:
            raise RuntimeError(f"cannot join the KV pool at {master}: its master does not "
                               f"accept connections (waited {JOIN_WAIT_S:g}s)")
        time.sleep(0.5)
    store = MooncakeDistributedStore()
    rc = store.setup(local_host, "P2PHANDSHAKE", segment_bytes, 64 << 20, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"cannot join the KV pool at {master} (Mooncake Store setup returned {rc})")
    return store


def attach_pool(config, model_config, runner, block_manager) -> PoolCache | None:
    """Called by ``LLMEngine`` at start: joins the pool ``config.kv_pool`` names (None
    without one) and gives it to the block manager. Refuses what it cannot serve."""
    if not config.kv_pool:
        return None
    from pdserve.engine.config import ConfigError
    from pdserve.engine.kv_transfer.setup import model_identity

    if runner.kv_cache.device.type != "cpu":
        raise ConfigError(f"the KV pool moves host memory only; this engine's KV cache is on "
                          f"{runner.kv_cache.device} (use --device cpu, or no --kv-pool)")
    prefix = f"{model_identity(config, model_config)}/{config.dtype}/{config.block_size}"
    store = connect(config.kv_pool, config.kv_host, config.kv_pool_segment_bytes)
    block_manager.pool = PoolCache(store, runner.kv_cache, prefix, config.kv_pool)
    log.info("KV pool at %s: contributing %.0f MiB", config.kv_pool,
             config.kv_pool_segment_bytes / 2**20)
    return block_manager.pool
