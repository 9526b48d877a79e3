"""Paged KV block bookkeeping (no torch): allocation, prefix caching, eviction.

Blocks are fixed-size pages of the KV cache. Each request owns a block table (a list
of block ids). A *full* block whose tokens are all computed gets a content hash
chained from its predecessor's hash, so two requests with the same prefix share the
same physical blocks.

Invariants:
- ``ref_count`` of a block equals the number of live requests whose block table
  holds it; a block is in ``_free`` exactly when its ref_count is 0.
- A free block that carries a hash stays findable in ``_cached`` until it is handed
  out for new content (LRU: the block freed longest ago is reused first).
- ``num_free_blocks + used == num_blocks`` at all times; after every request ends
  the free pool is full again (tests check this as the leak check).
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.request import Request
from pdserve.runtime.block_hash import hash_block


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_count = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        # Told of every hash that becomes findable or stops being so (kv_events.py).
        self.events: KVEventLog | None = None
        # The cluster's shared KV pool (kv_pool.py PoolCache), if any.
        self.pool = None
        # Prefix-cache counters, in tokens.
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        # Blocks and running slots the scheduler's waiting requests need (set by the
        # scheduler each step): preempted streams to come back, local prefills to start.
        # A reservation for a KV transfer leaves them (``kv_transfer/decode.py``), or on
        # a full decode engine new transfers take every block and seat that frees up and
        # a waiting request starves until its client's deadline.
        self.owed_blocks = 0
        self.free_seats = 1 << 30  # running slots (``max_num_seqs``) the waiting leave

    # -- queries -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _ensure_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend the request's hash chain to cover its full blocks within ``num_tokens``."""
        bs = self.block_size
        tokens = None
        while (len(request.block_hashes) + 1) * bs <= num_tokens:
            if tokens is None:
                tokens = request.all_token_ids
            i = len(request.block_hashes)
            parent = request.block_hashes[-1] if i else None
            request.block_hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))

    def find_cached_blocks(self, request: Request) -> list[int]:
        """Longest run of cached blocks that prefixes ``request``'s tokens.

        Called by the scheduler before first admitting a request. Leaves at least one
        token uncached, since the last token must be computed to produce logits; a
        request still owed prompt logprobs gets no hits (cached positions have no
        logits: it computes its whole prompt). No side effects on blocks.
        """
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return []
        limit = (request.num_tokens - 1) // self.block_size
        self._ensure_hashes(request, limit * self.block_size)
        hits = self._local_hits(request.block_hashes[:limit])
        if self.pool is not None and len(hits) < limit:
            # Blocks the shared pool has become cached blocks here (kv_pool.py).
            self.pool.fill(self, request.block_hashes[len(hits):limit], set(hits))
            hits += self._local_hits(request.block_hashes[len(hits):limit])
        return hits

    def _local_hits(self, hashes: list[bytes]) -> list[int]:
        hits = []
        for block_hash in hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def take_blocks_for_fill(self, n: int, keep: set[int]) -> list[int]:
        """Up to ``n`` free blocks (least recently used first, none of ``keep``), taken
        for the pool to write into; called by ``PoolCache.fill`` only."""
        blocks = []
        for block_id in self._free:
            if len(blocks) == n:
                break
            if block_id not in keep:
                blocks.append(block_id)
        for block_id in blocks:
            self._take(block_id)
            self._forget_hash(block_id)
        return blocks

    def finish_fill(self, blocks: list[int], hashes: list[bytes]) -> None:
        """The pool wrote ``hashes``' bytes into the first blocks: they become cached
        blocks (free, findable); the rest go back empty."""
        for i, block_id in enumerate(blocks):
            block_hash = hashes[i] if i < len(hashes) else None
            if block_hash is not None and block_hash not in self._cached:
                self._cached[block_hash] = block_id
                self._block_hash[block_id] = block_hash
                if self.events is not None:
                    self.events.stored(block_hash)
            self._ref_count[block_id] -= 1
            self._free[block_id] = None

    # -- mutations -----------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None,
        keep_free: int = 0,
    ) -> bool:
        """Make ``request``'s block table cover its computed tokens plus ``num_new_tokens``.

        Called by the scheduler each step for each scheduled request, and by the KV
        connector's decode side to reserve a request's destination blocks. ``cached_blocks``
        (first admission only) are prefix-cache hits to share. ``keep_free``: blocks the
        allocation must leave free (a reservation leaves ``owed_blocks``). All or
        nothing: on False nothing changed and the caller may preempt someone and retry.
        """
        cached_blocks = cached_blocks or []
        num_touched_free = sum(1 for b in cached_blocks if self._ref_count[b] == 0)
        num_total_blocks = len(request.block_table) + len(cached_blocks)
        num_needed = self.num_blocks_for(
            request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        ) - num_total_blocks
        if max(num_needed, 0) > self.num_free_blocks - num_touched_free - keep_free:
            return False
        for block_id in cached_blocks:
            self._take(block_id)
            request.block_table.append(block_id)
        if cached_blocks:
            num_hit = len(cached_blocks) * self.block_size
            request.num_computed_tokens += num_hit
            request.num_cached_tokens = num_hit
        for _ in range(max(num_needed, 0)):
            block_id = next(iter(self._free))
            self._take(block_id)
            self._forget_hash(block_id)
            request.block_table.append(block_id)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's computed full blocks to the prefix cache.

        Called by the scheduler after a step advanced ``num_computed_tokens``.
        """
        if not self.enable_prefix_caching:
            return
        self._ensure_hashes(request, request.num_computed_tokens)
        num_full = request.num_computed_tokens // self.block_size
        for i in range(num_full):
            block_id = request.block_table[i]
            block_hash = request.block_hashes[i]
            # A duplicate (same content computed twice concurrently) stays private.
            if self._block_hash[block_id] is None and block_hash not in self._cached:
                self._cached[block_hash] = block_id
                self._block_hash[block_id] = block_hash
                if self.events is not None:
                    self.events.stored(block_hash)
                if self.pool is not None:
                    self.pool.stored(block_hash, block_id)

    def free(self, request: Request) -> None:
        """Release every block of ``request``. Called only by the scheduler, once when the
        request is preempted, ends, or its blocks come back from the KV connector.

        Tail blocks go to the free list first so that, under LRU, a shared prefix
        outlives the request-specific suffix.
        """
        for block_id in reversed(request.block_table):
            self._ref_count[block_id] -= 1
            assert self._ref_count[block_id] >= 0, f"double free of block {block_id}"
            if self._ref_count[block_id] == 0:
                self._free[block_id] = None
        request.block_table = []

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._free):
            self._forget_hash(block_id)

    # -- internals -----------------------------------------------------------

    def _take(self, block_id: int) -> None:
        if self._ref_count[block_id] == 0:
            del self._free[block_id]
        self._ref_count[block_id] += 1

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            if self._cached.get(block_hash) == block_id:
                del self._cached[block_hash]
                if self.events is not None:
                    self.events.removed(block_hash)
            self._block_hash[block_id] = None

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_query_tokens += num_query_tokens
        self.num_prefix_hit_tokens += num_hit_tokens
