"""The instance view: which engines exist, their role, KV endpoint, compat hash and load.

Each engine is one ``EngineEndpoint`` (the Coordinator's picture of a PDInstance).
``InstanceRegistry`` is written by one source (the static poller or the Controller
watcher) through ``replace``, and read by the router on every request.
It also owns one ``engines.Engine`` per engine address (made by ``connect``: by
default ``vllm_engine.VllmEngine`` for a ``vllm://`` address, else
``sessions.EmbeddedEngine``), which every call to that engine goes
through, and the Coordinator's own count of legs in flight per engine (exact,
unlike polled load).

Invariants: only ``routable`` instances (healthy, not draining) are in pools; an
instance that just failed a leg is ``suspect`` for ``suspect_s``, and one that just
answered "full" is avoided for a moment (``mark_full``): either is picked only when
nothing else is left; waiters on ``wait_changed`` wake on every change.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.runtime.aio import wait_event
from pdserve.runtime.engine_client import EngineClient
from pdserve.runtime.security import SecuritySettings
from pdserve.runtime.vllm_server import is_vllm_address

from .engines import Engine
from .sessions import EmbeddedEngine
from .vllm_engine import VllmBackend


@dataclass
class EngineEndpoint:
    """One engine as the router sees it. The view's fields are written by the view
    source; the Coordinator-side counters by the legs running on it (``legs.Leg``)."""

    instance_id: str
    address: str
    role: str  # "prefill" | "decode" | "hybrid"
    kv_endpoint: str = ""
    kv_compat_hash: str = ""
    healthy: bool = True
    draining: bool = False
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_free: int = 0
    block_size: int = 0
    max_model_len: int = 0  # longest request (prompt + output) it takes; 0: not reported
    # Coordinator-side, exact: legs in flight and prompt tokens not yet prefilled.
    num_inflight: int = 0
    inflight_at_report: int = 0  # ``num_inflight`` when the view's load was last written
    num_pending_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0  # EWMA from observed prefill timings; 0: unknown
    suspect_until: float = 0.0
    full_until: float = 0.0  # it answered "full": avoided until then (monotonic seconds)

    def is_full(self, now: float) -> bool:
        return self.full_until > now

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    @property
    def kv_usage(self) -> float:
        total = self.num_kv_blocks_used + self.num_kv_blocks_free
        return self.num_kv_blocks_used / total if total else 0.0

    @property
    def queue_depth(self) -> int:
        """Requests ahead of a new one: our own legs now (exact) and the others' the last
        report had beyond ours then (other Coordinators', up to a report old). Not the
        report alone: when a wave of streams ends together, the report still counts them
        until the next one, and a wave of new requests would all go elsewhere."""
        return self.num_inflight + max(0, self.num_running + self.num_waiting - self.inflight_at_report)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """Called by a leg when the engine reports how long a prefill of ``num_tokens`` took."""
        if seconds > 0 and num_tokens:
            rate = num_tokens / seconds
            old = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if old == 0 else 0.8 * old + 0.2 * rate


VIEW_FIELDS = (
    "address", "role", "kv_endpoint", "kv_compat_hash", "healthy", "draining", "num_running",
    "num_waiting", "num_kv_blocks_used", "num_kv_blocks_free", "block_size", "max_model_len",
)


@dataclass
class Pools:
    prefill: list[EngineEndpoint] = field(default_factory=list)
    decode: list[EngineEndpoint] = field(default_factory=list)
    hybrid: list[EngineEndpoint] = field(default_factory=list)


class InstanceRegistry:
    def __init__(self, security: SecuritySettings | None = None, suspect_s: float = 5.0,
                 connect: Callable[[str], Engine] | None = None) -> None:
        """``connect(address)`` makes the ``Engine`` of an address (default: a vLLM
        server's for a ``vllm://`` address, else the embedded engine's, with ``security``)."""
        self._security = security or SecuritySettings.from_env()
        self._suspect_s = suspect_s
        self._connect = connect or self._by_address
        self._vllm: VllmBackend | None = None
        self._instances: dict[str, EngineEndpoint] = {}
        self._engines: dict[str, Engine] = {}
        self._changed = asyncio.Event()
        self.mode = "PD"  # the Controller's view mode: "PD" | "FALLBACK"
        self.fallback_reason = ""
        self.recent_events: list[str] = []  # the Controller's, newest last
        self.version = 0
        self.on_failed = None  # called with an instance id after mark_failed (pair checks)

    # -- written by the view source (static poller / Controller watcher) --

    def replace(self, instances: list[EngineEndpoint], mode: str = "PD", reason: str = "",
                events: list[str] | None = None) -> None:
        """A whole new view. Instances that stay keep their object (requests hold it)
        and Coordinator-side counters; only the view's fields are updated."""
        new: dict[str, EngineEndpoint] = {}
        for inst in instances:
            old = self._instances.get(inst.instance_id)
            if old is None:
                inst.inflight_at_report = inst.num_inflight
            else:
                if (inst.num_running, inst.num_waiting) != (old.num_running, old.num_waiting):
                    old.inflight_at_report = old.num_inflight  # a new report of its load
                for name in VIEW_FIELDS:
                    setattr(old, name, getattr(inst, name))
                inst = old
            new[inst.instance_id] = inst
        self._instances = new
        self.mode, self.fallback_reason = mode, reason
        if events is not None:
            self.recent_events = events
        self.version += 1
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def notify_changed(self) -> None:
        """Called by the pair checks when the usable pairs changed: waiters re-plan."""
        self._notify()

    async def wait_changed(self, timeout_s: float) -> None:
        """Called by the router while a request queues for a pool to come back, and by
        the KV event feeds (``wait_event``: a cancellation is never lost)."""
        await wait_event(self._changed, timeout_s)

    # -- read by the router and the request lifecycle --

    def all(self) -> list[EngineEndpoint]:
        return list(self._instances.values())

    def get(self, instance_id: str) -> EngineEndpoint | None:
        return self._instances.get(instance_id)

    def pools(self, exclude: set[str] = frozenset()) -> Pools:
        """Routable instances by role; suspects and ``exclude`` only as a last resort."""
        now = time.monotonic()
        pools = Pools()
        spare = Pools()
        for inst in self._instances.values():
            if not inst.routable:
                continue
            avoid = inst.suspect_until > now or inst.is_full(now) or inst.instance_id in exclude
            getattr(spare if avoid else pools, inst.role).append(inst)
        for role in ("prefill", "decode", "hybrid"):
            if not getattr(pools, role):
                setattr(pools, role, getattr(spare, role))
        return pools

    def max_model_len(self) -> int:
        """The longest request every routable engine takes (the smallest of what they
        report), 0 while none reports one. Read per request by serving, and by /v1/models."""
        lens = [i.max_model_len for i in self._instances.values() if i.routable and i.max_model_len]
        return min(lens, default=0)

    def mark_failed(self, instance_id: str) -> None:
        """Called by the lifecycle when a leg on this instance failed."""
        inst = self._instances.get(instance_id)
        if inst is not None:
            inst.suspect_until = time.monotonic() + self._suspect_s
        if self.on_failed is not None:
            self.on_failed(instance_id)

    def mark_full(self, instance_id: str, seconds: float) -> None:
        """Called by the lifecycle when this instance answered "full": other requests
        try the rest of its pool first for ``seconds``. Not a failure: its health and
        its suspect time are untouched."""
        inst = self._instances.get(instance_id)
        if inst is not None:
            inst.full_until = max(inst.full_until, time.monotonic() + seconds)

    def _by_address(self, address: str) -> Engine:
        if is_vllm_address(address):
            if self._vllm is None:
                self._vllm = VllmBackend()
            return self._vllm.connect(address)
        return EmbeddedEngine(EngineClient(address, self._security))

    def engine(self, address: str) -> Engine:
        """The engine at ``address``, connected on first use (not opened: that is its own
        business on its first call)."""
        engine = self._engines.get(address)
        if engine is None:
            engine = self._engines[address] = self._connect(address)
        return engine

    def session_transports(self) -> dict[str, str]:
        """Each engine address with an open session and what it rides; /ready?verbose=1."""
        return {address: e.transport for address, e in self._engines.items() if e.transport}

    async def close(self) -> None:
        for engine in self._engines.values():
            await engine.close()
        self._engines.clear()
