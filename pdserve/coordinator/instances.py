"""The instance view: which engines exist, their role, KV endpoint, compat hash and load.

Each engine is one ``EngineEndpoint`` (the Coordinator's picture of a PDInstance).
``InstanceRegistry`` is written by one source (the static poller or the Controller
watcher) through ``replace`` or ``apply_view``, and read by the router on every request.
It also owns one ``engines.Engine`` per engine address (made by ``connect``: by
default ``vllm_engine.VllmEngine`` for a ``vllm://`` address, else
``sessions.EmbeddedEngine``), which every call to that engine goes
through, and the Coordinator's own count of legs in flight per engine (exact,
unlike polled load).

Invariants: only ``routable`` instances (healthy, not draining) are in pools; an
instance that just failed a leg is ``suspect`` for ``suspect_s``, and one that just
answered "full" is avoided for a moment (``mark_full``): either is picked only when
nothing else is left; an engine whose open session ended is suspect from then until it
answers Health again or leaves the view (``engine_lost``); waiters on ``wait_changed``
wake on every change.

Cost: a view O(N), an instance whose view fields all stay one tuple compare (a
Controller view of a thousand engines applied in a few milliseconds). What a request
reads is kept: ``max_model_len()`` until the next view, and ``pools()`` (no
``exclude``) until a view changes an instance's
``MEMBER_FIELDS`` or the set of instances (``members_version``), an instance is marked
failed or full, or one of those marks runs out; a view of new load figures keeps it.
So view fields are written through a view alone, never on an instance in place.
With ``exclude`` (a retry) pools are built afresh, O(N). Each pool is a ``Pool``, in
id order, whose ``order`` (``load_order``) keeps its engines ordered by load as their
load fields are written, so the policies find the least loaded in O(log N).
"""

from __future__ import annotations

import asyncio
import operator
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property

from pdserve.runtime.aio import wait_event
from pdserve.runtime.engine_client import EngineClient
from pdserve.runtime.security import SecuritySettings
from pdserve.runtime.vllm_server import is_vllm_address

from .engine_errors import EngineCallError
from .engines import Engine
from .load_order import LoadOrder
from .sessions import EmbeddedEngine
from .vllm_engine import VllmBackend

LOST_RECHECK_S = 0.5  # a lost engine's Health, asked this often until it answers

LOAD_FIELDS = frozenset({"num_inflight", "inflight_at_report", "num_running", "num_waiting",
                         "num_kv_blocks_used", "num_kv_blocks_free"})
"""What ``queue_depth`` and ``kv_usage`` are read from: writing one marks the engine in
its pools' load orders (``load_order``)."""


@dataclass
class EngineEndpoint:
    """One engine as the router sees it. The view's fields are written by the view
    source; the Coordinator-side counters by the legs running on it (``legs.Leg``)."""

    _load_orders = ()  # not a field: weak references to the LoadOrders it is in (``watch_load``)

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
    # Published pair checks (a Controller's view, ``PublishedPairs``): a prefill engine's
    # agent has probed every decode peer listed at or before ``peers_checked_version``;
    # a decode engine was listed (at its KV endpoint) at ``peers_listed_version``.
    peers_checked_version: int = 0
    peers_listed_version: int = 0
    # Coordinator-side, exact: legs in flight and prompt tokens not yet prefilled.
    num_inflight: int = 0
    inflight_at_report: int = 0  # ``num_inflight`` when the view's load was last written
    num_pending_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0  # EWMA from observed prefill timings; 0: unknown
    suspect_until: float = 0.0
    full_until: float = 0.0  # it answered "full": avoided until then (monotonic seconds)

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name in LOAD_FIELDS:
            self.load_written()

    def load_written(self) -> None:
        """Marks it in its load orders: called on every write of a load field (a view
        writing several at once writes them past ``__setattr__`` and calls this once)."""
        for ref in self._load_orders:
            order = ref()
            if order is not None:
                order.mark(self)

    def watch_load(self, order: LoadOrder) -> None:
        """Called by a ``LoadOrder`` it is in: told of every write of its load from now
        (weakly: the orders of pools the registry dropped drop out here)."""
        self._load_orders = [*(r for r in self._load_orders if r() is not None), weakref.ref(order)]

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
    "peers_checked_version", "peers_listed_version",
)

MEMBER_FIELDS = ("role", "kv_endpoint", "kv_compat_hash", "healthy", "draining",
                 "peers_checked_version", "peers_listed_version")
"""The view fields pools, pairings and pair checks read (load aside): a view that changes
one of them on some instance bumps ``InstanceRegistry.members_version``."""

view_values = operator.attrgetter(*VIEW_FIELDS)
"""An instance's ``VIEW_FIELDS`` values, in that order (one C call)."""
_MEMBER_AT = frozenset(VIEW_FIELDS.index(name) for name in MEMBER_FIELDS)
_RUNNING_AT, _WAITING_AT = VIEW_FIELDS.index("num_running"), VIEW_FIELDS.index("num_waiting")
_ALL_AT = range(len(VIEW_FIELDS))
_set = object.__setattr__
_LOAD_AT = tuple(i for i, name in enumerate(VIEW_FIELDS) if name in LOAD_FIELDS)
_others = operator.itemgetter(*(i for i in _ALL_AT if i not in _LOAD_AT))


@dataclass(frozen=True)
class PublishedPairs:
    """The Controller's pair checks, as its view publishes them: the NodeAgent of each
    prefill engine probes the decode peers the Controller lists to it and reports the
    ones it cannot reach (``nodeagent/peers.py``). A pair is known once P's agent has
    checked the list D entered (``peers_checked_version >= peers_listed_version``), and
    usable when known and not among ``unusable`` (usually empty: exceptions only, so the
    view stays O(engines)). A new engine's pairs are unknown, so not routed, until then."""

    unusable: dict[tuple[str, str], str] = field(default_factory=dict)  # (P id, D id) -> reason

    def usable(self, p: EngineEndpoint, d: EngineEndpoint) -> bool:
        return self.reason(p, d) == ""

    def reason(self, p: EngineEndpoint, d: EngineEndpoint) -> str:
        """Why the pair is not usable, or "" when it is."""
        if not d.peers_listed_version:
            return f"{d.instance_id} is not listed to the prefill engines' agents yet"
        if p.peers_checked_version < d.peers_listed_version:
            return f"{p.instance_id}'s agent has not probed {d.instance_id} yet"
        return self.unusable.get((p.instance_id, d.instance_id), "")


class Pool(list):
    """One role's routable instances in id order, as ``InstanceRegistry.pools`` hands them
    out; never changed once built. ``order``: the same ordered by load, for the policies."""

    @cached_property
    def order(self) -> LoadOrder:
        return LoadOrder(self)

    @cached_property
    def by_id(self) -> dict[str, EngineEndpoint]:
        return {i.instance_id: i for i in self}


@dataclass
class Pools:
    """Routable instances by role. Read it, never change it: the registry hands the same
    one to every request until it changes (``Cost`` above)."""

    prefill: list[EngineEndpoint] = field(default_factory=Pool)
    decode: list[EngineEndpoint] = field(default_factory=Pool)
    hybrid: list[EngineEndpoint] = field(default_factory=Pool)

    @cached_property
    def members(self) -> tuple:
        """Which objects the prefill and decode pools hold: the router's pairing key."""
        return tuple(map(id, self.prefill)), tuple(map(id, self.decode))


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
        self._lost: dict[str, asyncio.Task] = {}  # address -> its ``_watch_lost``
        self._changed = asyncio.Event()
        self.mode = "PD"  # the Controller's view mode: "PD" | "FALLBACK"
        self.fallback_reason = ""
        self.recent_events: list[str] = []  # the Controller's, newest last
        self.version = 0  # every view
        self.members_version = 0  # views that changed the instances or their MEMBER_FIELDS
        self._pools: Pools | None = None  # pools() without exclude, kept (``Cost`` above)
        self._pools_until = 0.0  # monotonic: a suspect or full mark in them runs out
        self._max_model_len: int | None = None  # max_model_len(), kept until the next view
        self.on_failed = None  # called with an instance id after mark_failed (pair checks)
        self.published_pairs: PublishedPairs | None = None  # the Controller's, when its view has them

    # -- written by the view source (static poller / Controller watcher) --

    def replace(self, instances: list[EngineEndpoint], mode: str = "PD", reason: str = "",
                events: list[str] | None = None, pairs: PublishedPairs | None = None) -> None:
        """A whole new view of ``EngineEndpoint``s: ``apply_view`` of their view fields;
        a new instance is the object given."""
        self.apply_view(((i.instance_id, view_values(i), i) for i in instances), mode, reason, events, pairs)

    def apply_view(self, views: Iterable[tuple[str, tuple, EngineEndpoint | None]], mode: str = "PD",
                   reason: str = "", events: list[str] | None = None,
                   pairs: PublishedPairs | None = None) -> None:
        """A whole new view: per instance its id, its ``VIEW_FIELDS`` values in that
        order, and the object to hold if it is new (None: one made from the values).
        Instances that stay keep their object (requests hold it) and Coordinator-side
        counters; only the view fields that changed are written. ``pairs``: the
        Controller's pair checks, when its view publishes them (None: the Coordinator's
        own ``PairChecks`` probe every pair)."""
        new: dict[str, EngineEndpoint] = {}
        members_changed = pairs != self.published_pairs
        self.published_pairs = pairs
        for instance_id, values, given in views:
            inst = self._instances.get(instance_id)
            if inst is None:
                inst = given or EngineEndpoint(instance_id, **dict(zip(VIEW_FIELDS, values, strict=True)))
                inst.inflight_at_report = inst.num_inflight
                members_changed = True
            elif (have := view_values(inst)) != values:
                if have[_RUNNING_AT] != values[_RUNNING_AT] or have[_WAITING_AT] != values[_WAITING_AT]:
                    inst.inflight_at_report = inst.num_inflight  # a new report of its load
                if _others(have) == _others(values):  # most views change the load alone
                    for index in _LOAD_AT:  # not through ``__dict__``: it would slow every read
                        _set(inst, VIEW_FIELDS[index], values[index])
                    inst.load_written()
                else:
                    for index in _ALL_AT:
                        if have[index] != values[index]:
                            setattr(inst, VIEW_FIELDS[index], values[index])
                            members_changed |= index in _MEMBER_AT
            new[instance_id] = inst
        if members_changed or len(new) != len(self._instances):
            self.members_version += 1
            self._pools = None
        self._instances = new
        self._max_model_len = None
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
        """Routable instances by role; suspects and ``exclude`` only as a last resort.
        Called by the router per request: without ``exclude``, the kept ``Pools``."""
        now = time.monotonic()
        if not exclude and self._pools is not None and now < self._pools_until:
            return self._pools
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
            getattr(pools, role).sort(key=_instance_id)
        if not exclude:
            marks = [t for i in self._instances.values() if i.routable
                     for t in (i.suspect_until, i.full_until) if t > now]
            self._pools, self._pools_until = pools, min(marks, default=float("inf"))
        return pools

    def max_model_len(self) -> int:
        """The longest request every routable engine takes (the smallest of what they
        report), 0 while none reports one. Read per request by serving, and by /v1/models:
        worked out once per view."""
        if self._max_model_len is None:
            lens = [i.max_model_len for i in self._instances.values() if i.routable and i.max_model_len]
            self._max_model_len = min(lens, default=0)
        return self._max_model_len

    def mark_failed(self, instance_id: str) -> None:
        """Called by the lifecycle when a leg on this instance failed."""
        inst = self._instances.get(instance_id)
        if inst is not None:
            inst.suspect_until = time.monotonic() + self._suspect_s
            self._pools = None
        if self.on_failed is not None:
            self.on_failed(instance_id)

    def mark_full(self, instance_id: str, seconds: float) -> None:
        """Called by the lifecycle when this instance answered "full": other requests
        try the rest of its pool first for ``seconds``. Not a failure: its health and
        its suspect time are untouched."""
        inst = self._instances.get(instance_id)
        if inst is not None:
            inst.full_until = max(inst.full_until, time.monotonic() + seconds)
            self._pools = None

    def _by_address(self, address: str) -> Engine:
        if is_vllm_address(address):
            if self._vllm is None:
                self._vllm = VllmBackend()
            return self._vllm.connect(address)
        return EmbeddedEngine(EngineClient(address, self._security),
                              on_lost=lambda: self.engine_lost(address))

    def engine_lost(self, address: str) -> None:
        """Called by the engine at ``address`` when its open session ended (it died,
        restarted or dropped it): its instances are suspect at once, where the
        Controller's view says so only after its agent's next heartbeat, and stay suspect
        while the address is in the view and does not answer Health (``_watch_lost``)."""
        ids = [i.instance_id for i in self._instances.values() if i.address == address]
        for instance_id in ids:
            self.mark_failed(instance_id)
        self._hold_lost(address)
        if ids and address not in self._lost:
            self._lost[address] = asyncio.get_running_loop().create_task(self._watch_lost(address))

    async def _watch_lost(self, address: str) -> None:
        """Health of a lost engine every ``LOST_RECHECK_S``: while it does not answer and
        the view still lists it, its instances' suspect time is moved on; ends when it
        answers (its suspect time runs out as any) or leaves the view."""
        try:
            while True:
                await asyncio.sleep(LOST_RECHECK_S)
                engine = self._engines.get(address)
                if engine is None or all(i.address != address for i in self._instances.values()):
                    return
                try:
                    await engine.health(timeout_s=LOST_RECHECK_S)
                    return
                except EngineCallError:
                    self._hold_lost(address)
        finally:
            self._lost.pop(address, None)

    def _hold_lost(self, address: str) -> None:
        """The lost engine's instances suspect past the next Health check's answer."""
        until = time.monotonic() + max(self._suspect_s, 3 * LOST_RECHECK_S)
        for inst in self._instances.values():
            if inst.address == address:
                inst.suspect_until = max(inst.suspect_until, until)
        self._pools = None

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
        watches = list(self._lost.values())
        for task in watches:
            task.cancel()
        await asyncio.gather(*watches, return_exceptions=True)  # ended before their engines close
        for engine in self._engines.values():
            await engine.close()
        self._engines.clear()


def _instance_id(inst: EngineEndpoint) -> str:
    return inst.instance_id
