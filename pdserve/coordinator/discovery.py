"""Static instance view: a fixed list of engine addresses, each polled for Health and Stats.

Used when no Controller is configured. Every ``poll_interval_s`` each engine's
Health (role, KV endpoint, compat hash, draining) and Stats (queue depth, KV
usage, block size) are read concurrently. A busy engine is not a dead one: engines
answer both from a snapshot, never behind a step, and a probe that merely times out
keeps the engine's last view for up to ``MAX_SLOW_PROBES`` polls in a row; an engine
that refuses the connection or errors is unhealthy (not routable) at once, until it
answers again. A role change (e.g. an operator switching an engine to hybrid) is
seen at the next poll.
"""

from __future__ import annotations

import asyncio
import logging

from .engine_errors import DeadlinePassed, EngineCallError
from .instances import EngineEndpoint, InstanceRegistry
from .rounds import Rounds

log = logging.getLogger(__name__)

MAX_SLOW_PROBES = 3  # consecutive timed-out probes before a silent engine is unroutable
FIRST_PROBE_TIMEOUT_S = 2.0  # an engine not seen yet: the probe opens its connection too


class StaticDiscovery(Rounds):
    """Started by the app: one poll first, so routing starts with a view (``Rounds``)."""

    task_name = "static-discovery"

    def __init__(self, registry: InstanceRegistry, addresses: list[str], interval_s: float) -> None:
        self.registry = registry
        self.addresses = list(addresses)
        self.interval_s = interval_s
        self._num_slow: dict[str, int] = {}

    async def wait(self) -> None:
        await asyncio.sleep(self.interval_s)

    async def round(self) -> None:
        await self.poll_once()

    async def poll_once(self) -> None:
        found = await asyncio.gather(*(self._probe(a) for a in self.addresses))
        self.registry.replace(list(found))

    async def _probe(self, address: str) -> EngineEndpoint:
        engine = self.registry.engine(address)
        known = self.registry.get(address) is not None
        # an engine's first probe also opens its connection: a short poll's bound is too tight
        timeout_s = max(0.2, min(2.0, self.interval_s)) if known else FIRST_PROBE_TIMEOUT_S
        try:
            health, stats = await asyncio.gather(
                engine.health(timeout_s=timeout_s), engine.stats(timeout_s=timeout_s)
            )
        except (TimeoutError, EngineCallError) as exc:
            old = self.registry.get(address)
            if _is_timeout(exc) and old is not None and old.healthy:
                slow = self._num_slow[address] = self._num_slow.get(address, 0) + 1
                if slow < MAX_SLOW_PROBES:
                    return old  # slow, not gone: keep routing on its last view
            if old is None or old.healthy:
                log.warning("engine %s does not answer: %s", address, _short(exc))
            return EngineEndpoint(address, address, old.role if old else "unknown", healthy=False)
        self._num_slow.pop(address, None)
        return EngineEndpoint(
            instance_id=address, address=address, role=health.role,
            kv_endpoint=health.kv_endpoint, kv_compat_hash=health.kv_compat_hash,
            healthy=health.serving, draining=health.draining,
            num_running=stats.num_running, num_waiting=stats.num_waiting,
            num_kv_blocks_used=stats.num_kv_blocks_used,
            num_kv_blocks_free=stats.num_kv_blocks_free, block_size=stats.block_size,
            max_model_len=health.max_model_len,
        )


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, (TimeoutError, DeadlinePassed))


def _short(exc: BaseException) -> str:
    if isinstance(exc, EngineCallError):
        return str(exc)
    return type(exc).__name__
