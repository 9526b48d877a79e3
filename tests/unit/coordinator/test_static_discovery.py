"""Static discovery's probes: a busy engine is not a dead one, and an engine's first
probe (which opens its connection) is not held to a short poll's bound."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.coordinator.discovery import FIRST_PROBE_TIMEOUT_S, MAX_SLOW_PROBES, StaticDiscovery
from pdserve.coordinator.instances import InstanceRegistry
from pdserve.runtime.security import SecuritySettings


class SlowEngine:
    """Answers Health and Stats after ``delay_s``; past the caller's timeout it raises
    TimeoutError as the engine clients do."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def _answer(self, value, timeout_s: float):
        if self.delay_s > timeout_s:
            await asyncio.sleep(timeout_s)
            raise TimeoutError
        await asyncio.sleep(self.delay_s)
        return value

    async def health(self, timeout_s: float):
        return await self._answer(SimpleNamespace(role="prefill", kv_endpoint="kv:1", kv_compat_hash="h",
                                                  serving=True, draining=False, max_model_len=64), timeout_s)

    async def stats(self, timeout_s: float):
        return await self._answer(SimpleNamespace(num_running=0, num_waiting=0, num_kv_blocks_used=0,
                                                  num_kv_blocks_free=8, block_size=16), timeout_s)


@pytest.mark.asyncio
async def test_a_first_probe_slower_than_the_poll_interval_still_finds_the_engine():
    engine = SlowEngine(delay_s=0.5)  # more than the 0.2 s a 0.2 s poll allows a known engine
    assert FIRST_PROBE_TIMEOUT_S > 0.5
    registry = InstanceRegistry(SecuritySettings(), connect=lambda address: engine)
    discovery = StaticDiscovery(registry, ["p:1"], interval_s=0.2)
    await discovery.poll_once()
    found = registry.get("p:1")
    assert found is not None and found.healthy and found.role == "prefill"
    # known now: its probes are held to the poll's bound, and a slow one keeps its view
    # for MAX_SLOW_PROBES - 1 polls before it is unroutable
    for _ in range(MAX_SLOW_PROBES - 1):
        await discovery.poll_once()
        assert registry.get("p:1").healthy
    await discovery.poll_once()
    assert not registry.get("p:1").healthy
    # an engine that never answers is unroutable after its first probe
    silent = StaticDiscovery(InstanceRegistry(SecuritySettings(), connect=lambda a: SlowEngine(9.0)), ["d:1"],
                             interval_s=0.2)
    await silent.poll_once()
    assert not silent.registry.get("d:1").healthy
