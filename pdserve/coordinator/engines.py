"""The engine interface: everything the Coordinator asks of an engine, declared once.

The Coordinator drives engines it may not own. Each engine address is one
``Engine``, made on first use and kept by ``InstanceRegistry.engine`` (which calls
the registry's ``connect``, ``sessions.EmbeddedEngine`` unless told otherwise).
Everything above this interface (legs, the router, the pair checks, the prefix
index's event feeds, the status page) knows engines only through it:

  generate   ``Leg.start``: one request (a single, prefill or decode leg; its
             transfer parameters in ``request.kv_transfer``) started on the engine;
             returns the ``EngineCall`` its messages are read from
  abort      ``legs.Aborter``, for a leg that ended without finishing: the engine
             frees the request's KV even if the call's own cancel was lost
  health     ``StaticDiscovery`` (the engine's role, KV endpoint, compat hash, limits)
  stats      ``StaticDiscovery`` and the status page (running, waiting, KV blocks)
  probe_peer ``PairChecks``: this (prefill) engine checks its KV path to a decode
             engine's KV endpoint
  kv_events  ``KVEventFeeds``: the engine's prefix-cache events, for the prefix index
  transport  what its requests ride, for ``/ready?verbose=1`` ("" until the first)
  close      ``InstanceRegistry.close`` at the app's shutdown

Errors are pdserve's own (``engine_errors``), whichever the wire: ``EngineFailed``
(gone, broken, or it failed the request), ``EngineBusy`` (no room now: load, not a
failure), ``InputRefused`` (the client's input), ``DeadlinePassed``,
``CallCancelled``, ``Unsupported`` (the engine does not offer the call: a backend
without KV events or peer probes). The messages are the engine API's own types
(``api/proto/engine.proto``), which any backend can build.

A new engine backend subclasses ``Engine`` (and ``EngineCall``), and is chosen by
``InstanceRegistry(connect=...)``; docs/architecture.md says where it plugs in.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from pdserve.api.proto import engine_pb2 as pb


class EngineCall(ABC):
    """One request on an engine, as its leg reads it: an async iterator of the
    request's ``GenerateResponse`` messages that ends when the engine ends the request
    (its end raised as an ``engine_errors`` exception when not a plain end).

    ``holds`` (set by ``Leg.start`` right after ``generate``, before any message): the
    answer is read whole, so the messages after the first may be handed on together
    at the end, not one wake each; ``arrival_s`` then says when the message last read
    reached the Coordinator (``time.monotonic``). ``last_arrival_s``: when the last
    message arrived, read or not (0.0: none yet)."""

    request_id: str
    holds: bool = False
    arrival_s: float = 0.0
    last_arrival_s: float = 0.0

    def __aiter__(self) -> EngineCall:
        return self

    @abstractmethod
    async def __anext__(self) -> pb.GenerateResponse: ...

    @abstractmethod
    def cancel(self) -> bool:
        """Called by ``Leg.close`` for a leg that did not finish: the engine is told to
        stop the request; reading on raises ``CallCancelled``. False if it had ended."""


class Engine(ABC):
    """One engine as the Coordinator drives it (module docstring: who calls what)."""

    address: str

    @abstractmethod
    def generate(self, request: pb.GenerateRequest, timeout_s: float | None = None,
                 idle_s: float | None = None, end_s: float = math.inf) -> EngineCall:
        """Starts ``request``; the call fails with ``DeadlinePassed`` (and the request
        is cancelled on the engine) when no message came within ``timeout_s``, or, with
        ``idle_s``, none within ``idle_s`` of the last one, or at ``end_s`` (monotonic);
        without ``idle_s``, after ``timeout_s`` whatever came. Never blocks: a
        connection still opening queues the request."""

    @abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Ends the request and frees its KV; True if the engine knew it."""

    @abstractmethod
    async def health(self, timeout_s: float = 2.0) -> pb.HealthResponse: ...

    @abstractmethod
    async def stats(self, timeout_s: float = 2.0) -> pb.StatsResponse: ...

    @abstractmethod
    async def probe_peer(self, endpoint: str, test_transfer: bool = False,
                         timeout_s: float = 5.0) -> pb.ProbePeerResponse: ...

    @abstractmethod
    def kv_events(self, epoch: str = "", since_seq: int = 0,
                  block_size: int = 0) -> AsyncIterator[pb.KVEventBatch]:
        """The engine's prefix-cache events, resuming after (``epoch``, ``since_seq``)
        when it can (a fresh snapshot when not); ``block_size``: the caller's, for an
        engine whose own block hashes it must translate."""

    @property
    def transport(self) -> str:
        return ""

    @property
    def num_calls(self) -> int:
        """Requests started and not ended (status, tests)."""
        return 0

    @abstractmethod
    async def close(self) -> None: ...
