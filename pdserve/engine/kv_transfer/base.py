"""The KV connector interface: every call an engine makes to move a request's KV.

An engine with a KV transport holds one ``KVConnector`` (``dispatch.DispatchConnector``:
a prefill side in ``prefill.py``, a decode side in ``decode.py``, one worker moving
the bytes). ``LLMEngine`` and its ``Scheduler`` call only what is declared here; they
never reach the worker or the transport. Unless a method says otherwise, it is called
on the engine thread (the one thread that owns the engine) and never blocks on the
network.

One owner for a request's blocks: the scheduler frees them, always. When a request
ends (finished, aborted, failed, handed off), ``Scheduler.finish`` asks
``request_finished`` once; True means "writes may still land, I keep the blocks",
and the connector later hands them back as ``ConnectorEvents.released``, which the
scheduler frees. The connector allocates destination blocks (D) but never frees one.

Overload is not failure: a decode leg for which D finds no free blocks within
``ConnectorTimeouts.reserve_wait_s`` is refused, and so is its prefill leg on P; both
are raised as ``full`` (not ``failed``), and the requests end ``FINISHED_FULL`` with
an error starting "decode full", which the server answers as RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.request import Request

if TYPE_CHECKING:
    from pdserve.engine.kv_transfer.layout import KVLayout
    from pdserve.engine.kv_transfer.params import KVTransferParams
    from pdserve.engine.kv_transfer.probe import ProbeDone

LayerHook = Callable[[int], None]


@dataclass
class ConnectorEvents:
    """What changed since the last ``collect_events``; applied by ``Scheduler.apply_kv_events``
    in this order (a request that ended meanwhile is skipped)."""

    ready: list[Request] = field(default_factory=list)  # P: destination known, may prefill now
    exposed: list[tuple[Request, int, int | None]] = field(default_factory=list)  # D: (req, token, seed)
    handed_off: list[Request] = field(default_factory=list)  # P: done, D has the KV
    failed: list[tuple[Request, str]] = field(default_factory=list)
    # No room for the KV: D found no blocks within reserve_wait_s, or P heard so from D.
    full: list[tuple[Request, str]] = field(default_factory=list)
    released: list[Request] = field(default_factory=list)  # blocks kept at the end, free now

    def take(self) -> ConnectorEvents:
        """Everything raised so far, leaving this one empty."""
        taken = dataclasses.replace(self)
        for f in dataclasses.fields(self):
            setattr(self, f.name, [])
        return taken


class KVConnector(abc.ABC):
    """The engine-facing connector. Lifecycle of one transfer: ``admit`` → events from
    ``collect_events`` (and, on P, ``layer_hook`` and ``prefill_done``) →
    ``request_finished`` when the request ends → at most one ``released`` event."""

    # -- pairing: any thread (fixed at start-up) ---------------------------------------

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """The KV endpoint peers name as ``KVTransferParams.peer`` ("host:port")."""

    @property
    @abc.abstractmethod
    def transport_name(self) -> str:
        """tcp | shm | mooncake: the metrics' transport label."""

    @property
    @abc.abstractmethod
    def layout(self) -> KVLayout:
        """This engine's KV layout; ``layout.compat_hash`` must match a peer's to pair."""

    def describe(self) -> dict[str, str]:
        """Health and Stats fields for pairing (called from the gRPC thread too)."""
        return {"kv_transport": self.transport_name, "kv_endpoint": self.endpoint,
                "kv_compat_hash": self.layout.compat_hash}

    # -- probes and wake-ups ---------------------------------------------------------------

    @abc.abstractmethod
    def probe(self, peer: str, test_transfer: bool, timeout_s: float, done: ProbeDone) -> None:
        """Check the KV path to ``peer`` now (probe.py): a fresh layout handshake and, with
        ``test_transfer``, a real read of one block run from the peer into a scratch
        buffer; no request's blocks are read into or written on either side. Calls
        ``done(ProbeResult)`` exactly once on the engine thread, within ``timeout_s``
        (from ``collect_events``, which the engine keeps calling while a probe is live:
        probes count in ``num_pending``). Engine thread."""

    @abc.abstractmethod
    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` from a transport thread whenever a control message arrives, so
        an idle engine runs ``collect_events`` and answers handshakes and probes at once
        instead of at its next request. Called once by ``EngineLoop`` before it starts."""

    # -- admission -----------------------------------------------------------------------

    @abc.abstractmethod
    def has_transfer(self, transfer_id: str) -> bool:
        """Whether a live transfer already uses ``transfer_id`` (the engine refuses it)."""

    @abc.abstractmethod
    def admit(self, request: Request, params: KVTransferParams) -> bool:
        """Take ``request``'s leg (``params.role``): pins a prefill leg, puts a decode leg
        in ``WAITING_FOR_REMOTE_KV``, says HELLO to the peer once, replays messages that
        came before it. Returns True when the engine schedules the request now; False
        when the connector hands it back later (``ready`` on P, ``exposed`` on D)."""

    # -- every step ------------------------------------------------------------------------

    @abc.abstractmethod
    def collect_events(self) -> ConnectorEvents:
        """Called by the engine at the start of every step: reads control messages,
        advances every transfer and deadline, and returns what changed."""

    @abc.abstractmethod
    def layer_hook(self, batch_items: list[tuple[Request, int]]) -> LayerHook | None:
        """P, layer-wise: a callback for this batch, fired by the model on the engine
        thread once layer i's KV is in the cache; it only queues writes (the worker's
        sender thread submits them). None when nothing in the batch streams."""

    @abc.abstractmethod
    def prefill_done(self, request: Request, first_token: int) -> None:
        """Called by ``Scheduler.postprocess`` when a pinned (prefill-leg) request sampled
        its first token and left the running set: start or finish sending its KV."""

    # -- the end of a request ------------------------------------------------------------

    @abc.abstractmethod
    def request_finished(self, request: Request) -> bool:
        """Called once by ``Scheduler.finish`` after ``request`` latched its final state.
        A transfer still live is aborted (the peer told, with ``request.error`` or
        "aborted"). Returns True when the connector keeps the blocks because a write
        may still land: they come back later as one ``released`` event. Idempotent."""

    # -- state and shutdown ----------------------------------------------------------------

    @property
    @abc.abstractmethod
    def num_pending(self) -> int:
        """Transfers, kept block sets and probes that still need driving (the engine keeps
        stepping)."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """``StatsResponse`` fields: ``describe()`` plus transfer counters."""

    @abc.abstractmethod
    def add_observer(self, observe: Callable[[object, bool], None]) -> None:
        """Call ``observe(transfer, ok)`` on the engine thread for every finished transfer.
        Called once at start-up, before the engine thread runs (metrics)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the sender thread and the transport; called once at shutdown."""
