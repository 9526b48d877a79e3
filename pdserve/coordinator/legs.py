"""The legs of a request: one engine stream each, and the PD pair of two.

A leg is one request on one engine (an ``engines.EngineCall``), and knows only that
engine. ``Leg`` runs a whole request on one engine (conditional disaggregation on
D, or a hybrid engine); ``PrefillLeg`` and ``DecodeLeg`` are the halves of a PD
attempt, which ``PairedLegs`` runs together and owns the race of: the prefill leg
in a task of its own, the decode leg streamed, and until D's first message both
awaited with ``asyncio.wait``. Both shapes answer the same calls, made by
``RequestRun`` on the event loop:

  start(timeout_s, collects)
                     send the request(s), the first token due within ``timeout_s``;
                     count the load on their engines; with ``collects`` (the answer
                     is read whole, not streamed) the tokens after the first are
                     handed on together at the end (``SessionCall.holds``: one
                     wake, not one per message)
  tokens()           the output token ids, until the engine finishes the request
  arrival_s          (collecting) when the ids ``tokens`` last gave reached the Coordinator
  last_arrival_s     when the stream's last message reached the Coordinator
  wait_report()      (a PD pair whose decode leg finished) until P's report is in
  close()            restore the load counts; cancel and abort what did not finish
  stream_engine()    the engine streaming the tokens, while the stream may be cut
  interrupt()        cut the stream to move it (``moves.py``): ``tokens`` raises a
                     ``LegFailure`` of that engine, which ``RequestRun`` takes for a move

Deadlines (``deadlines.py``): a leg whose tokens are the stream's (a single or
decode leg) must get its first message within ``timeout_s`` and each later one
within the request's idle bound of the one before, never past its total; a prefill
leg's whole stream is before the first token, so ``timeout_s`` bounds all of it.

Outcomes other than tokens, from the call's end (``engine_errors``: pdserve's own,
whatever the wire): the client's (``ServeError`` 400: the engine refused the input,
never retried), the deadline's (504), load (``EngineFull``: the engine had no room,
"decode full" or "prefill full"; it is healthy, the request waits or goes
elsewhere), or the engine's failure (``LegFailure``, with the leg and the stage:
retryable on other engines). In a PD
attempt, a prefill failure before D's first message is the attempt's failure (D only
waits for the KV); after it, the failure is moot.

The first token of a PD attempt: P samples it at the end of its prefill; D sends it
once it has the KV and its loop finished the step it was in. It goes out with
whichever message of it comes first (``PairedLegs.tokens``), and D's copy is
dropped; once it went out, a failure is a continuation's (``mid_stream``).

Logprobs ride along the tokens: ``take_logprobs`` returns those of the tokens
yielded since the last call, ``prompt_logprobs`` the prompt's (from the engine that
prefilled). In a PD attempt the first token is P's, sampled and scored on P: when D's
message of it comes first, the decode leg waits for P's before yielding it (already
there but for a race of two streams); P's stream ending without it fails the attempt
like any P failure. Requests without logprobs wait for nothing.

Load counts on each ``EngineEndpoint``: one in flight per leg from ``start`` to
``close``; a single or prefill leg's prompt tokens are pending prefill until the
engine reports the prefill done (its first timings) or the leg is closed.

P's report: its stage timings (queue, compute, with its first message; transfer,
with its handoff) and its prefix-cache hits go into the request's timings as P's
messages are read, in P's task. D's messages ride another connection, so D's whole
answer can be read before P's; an answer whose D finished first waits for P's
stream to end (``PairedLegs.wait_report``, at most ``REPORT_WAIT_S``: D finishing
means the KV moved, so P's handoff is on its way) before the response ends.

Invariants: every started leg is closed, whatever ends the attempt (closing
``RequestRun.tokens`` on a client disconnect included); a closed leg that did not
finish is cancelled and aborted through the ``Aborter``, except a prefill leg
whose stream already ended, or whose decode leg finished: the KV moved, its
"handoff" is on the way and it ends by itself (no Abort RPC on the hot path).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from pdserve.api.proto import engine_pb2 as pb

from .deadlines import Deadlines
from .engine_errors import DeadlinePassed, EngineBusy, EngineCallError, InputRefused
from .engines import Engine
from .errors import ServeError
from .instances import EngineEndpoint, InstanceRegistry
from .timings import RequestTimings

log = logging.getLogger(__name__)
ABORT_TIMEOUT_S = 2.0
REPORT_WAIT_S = 2.0  # how long a finished answer waits for its prefill leg's report


class LegFailure(Exception):
    """An engine failed a leg; ``stage`` is when ("before_first_token", "before_handoff",
    "mid_stream"), ``reason`` a short label of how (a gRPC status name, a finish
    reason, "ended_early"). Raised by ``Leg.tokens``, handled by ``RequestRun``'s
    retry loop. ``str()`` names the engine's address and says all (for logs);
    ``public`` names neither the address nor gRPC's details, which carry addresses
    (for the client)."""

    def __init__(self, engine: EngineEndpoint, leg: str, stage: str, reason: str,
                 message: str, public_message: str | None = None) -> None:
        super().__init__(f"{leg} engine {engine.address}: {message}")
        self.engine = engine
        self.leg = leg
        self.stage = stage
        self.reason = reason
        self.public = f"{leg} engine: {public_message or message}"


class EngineFull(Exception):
    """The engine has no room for the leg now (it refused it before starting it).
    Not a failure: raised by ``Leg.tokens``, handled by ``RequestRun``, which tries
    engines with room or waits."""

    def __init__(self, engine: EngineEndpoint, leg: str, details: str) -> None:
        super().__init__(f"{leg} engine {engine.address}: {details}")
        self.engine = engine
        self.leg = leg
        self.details = details
        self.public = f"{leg} engine: {details}"


class Leg:
    """One request on an engine; this class is the single leg, the subclasses a PD pair's halves."""

    kind = "single"
    END_REASONS: tuple[str, ...] = ("stop", "length")  # finish reasons that end it well
    ENDED_EARLY = "stream ended without finishing"
    PREFILLS_PROMPT = True  # its engine prefills the prompt: counted as pending prefill
    STREAMS = True  # its messages are the stream's: bounded by the idle gap once it began
    has_pending_report = False  # see ``PairedLegs``

    def __init__(self, engine: EngineEndpoint, request: pb.GenerateRequest, client: Engine,
                 timings: RequestTimings, aborter: Aborter,
                 deadlines: Deadlines | None = None) -> None:
        self.engine = engine
        self.request = request
        self.has_token = False  # a token of the attempt went out (a pair's: maybe P's)
        self.finished = False
        self.finish_reason: str | None = None
        self._client = client
        self._timings = timings
        self._aborter = aborter
        self._deadlines = deadlines  # None: ``timeout_s`` bounds the whole leg
        self._call = None
        self._is_open = False
        self._has_timings = False
        self._num_pending = 0
        sampling = request.sampling
        self.wants_logprobs = sampling.logprobs or sampling.prompt_logprobs
        self.logprobs: list[pb.TokenLogprob] = []  # of the tokens yielded, not yet taken
        self.prompt_logprobs: list[pb.TokenLogprob] | None = None

    def start(self, timeout_s: float, collects: bool = False) -> None:
        """Called once, by ``RequestRun`` or ``PairedLegs.start``: sends the request, its
        first message due within ``timeout_s`` (what is left until the request's next
        token is due), counts the load."""
        d = self._deadlines
        if d is not None and self.STREAMS:
            self._call = self._client.generate(self.request, timeout_s, d.idle_s, d.end_s)
        else:
            self._call = self._client.generate(self.request, timeout_s=timeout_s)
        self._call.holds = collects
        self._is_open = True
        self.engine.num_inflight += 1
        if self.PREFILLS_PROMPT:
            self._num_pending = len(self.request.prompt_token_ids)
            self.engine.num_pending_prefill_tokens += self._num_pending

    async def tokens(self) -> AsyncIterator[list[int]]:
        """The token ids of each message, until a finish in ``END_REASONS``; raises the
        leg's failure classified. The one loop over the engine's messages."""
        stream = self._call
        while True:
            try:
                msg = await stream.__anext__()
            except StopAsyncIteration:
                raise self._failure("ended_early", self.ENDED_EARLY) from None
            except EngineCallError as exc:
                raise self._call_failure(exc) from None
            finished = msg.finished
            if finished and msg.finish_reason not in self.END_REASONS:
                raise self._failure(msg.finish_reason or "unfinished",
                                    f"finished with {msg.finish_reason}: {msg.error}")
            if not self._has_timings and msg.HasField("timings"):
                self._has_timings = True
                self._record_first(msg.timings)
                if self.PREFILLS_PROMPT:  # the first prefill's hits: the client's prompt
                    self._timings.report.setdefault("cached_tokens", msg.num_cached_tokens)
                    self._timings.observe_cached(msg.num_cached_tokens)
            ids = msg.token_ids[:]  # a list; one read of the field (upb builds a view per read)
            if ids:
                self.has_token = True
                if self.wants_logprobs:
                    self.logprobs.extend(msg.logprobs)
                    if self.prompt_logprobs is None and msg.prompt_logprobs:
                        self.prompt_logprobs = list(msg.prompt_logprobs)
            if finished:  # before its last tokens are handed on: a leg closed then is done
                self.finished = True
                self.finish_reason = msg.finish_reason
                self._record_end(msg.timings)
                if ids:
                    yield ids
                return
            if ids:
                yield ids

    @property
    def arrival_s(self) -> float:
        return self._call.arrival_s

    @property
    def last_arrival_s(self) -> float:
        return self._call.last_arrival_s

    def take_logprobs(self) -> list[pb.TokenLogprob]:
        """The logprobs of the tokens yielded since the last call (``RequestRun``)."""
        taken, self.logprobs = self.logprobs, []
        return taken

    def release(self) -> None:
        """Restores the engine's load counts; idempotent. Called by ``close`` and by
        ``PairedLegs`` for a prefill leg that ends by itself."""
        if self._is_open:
            self._is_open = False
            self.engine.num_inflight -= 1
            self._release_pending()

    def close(self) -> None:
        """Called once the attempt is over: ``release``, and unless the leg finished,
        cancel its call and abort it on the engine (its KV freed even if the
        cancellation is lost on the way)."""
        was_open = self._is_open
        self.release()
        if was_open and not self.finished:
            self._call.cancel()
            self._aborter.abort_soon(self.engine, self.request.request_id)

    def stream_engine(self) -> EngineEndpoint | None:
        """Its engine while its stream runs (``RequestRun.stream_engine``)."""
        return self.engine if self._is_open and not self.finished else None

    def interrupt(self) -> EngineEndpoint | None:
        """Cuts the stream (``RequestRun.move``): ``tokens`` raises a ``LegFailure`` of
        this engine once the messages already in are read. Returns the engine, or None
        when the call had ended already."""
        if self.stream_engine() is None or not self._call.cancel():
            return None
        return self.engine

    def _release_pending(self) -> None:
        self.engine.num_pending_prefill_tokens -= self._num_pending
        self._num_pending = 0

    def _stage(self) -> str:
        return "mid_stream" if self.has_token else "before_first_token"

    def _failure(self, reason: str, message: str, public_message: str | None = None) -> LegFailure:
        return LegFailure(self.engine, self.kind, self._stage(), reason, message, public_message)

    def _call_failure(self, exc: EngineCallError) -> Exception:
        if isinstance(exc, InputRefused):
            return ServeError(400, exc.details or "invalid request", code="invalid_request")
        if isinstance(exc, DeadlinePassed):
            return ServeError(504, "the request's deadline passed before it finished", code="deadline")
        if isinstance(exc, EngineBusy):
            return EngineFull(self.engine, self.kind, exc.details)
        return self._failure(exc.status, str(exc), exc.status)

    def _record_first(self, t: pb.Timings) -> None:
        """The engine's first timings: its prefill is done."""
        self._timings.observe("prefill_queue", t.queue_s)
        self._timings.observe("prefill_compute", t.prefill_s)
        self.engine.observe_prefill(len(self.request.prompt_token_ids), t.prefill_s)
        self._release_pending()

    def _record_end(self, t: pb.Timings) -> None:
        pass


class PrefillLeg(Leg):
    kind = "prefill"
    END_REASONS = ("handoff",)
    ENDED_EARLY = "stream ended without handoff"
    STREAMS = False  # all of it comes before the stream's first token

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.first_ids: list[int] | None = None  # the first token P sampled
        self.first_arrival_s = 0.0  # when its message reached the Coordinator
        self.first_token: asyncio.Future | None = None  # done at the first token or the end
        # (made by ``PairedLegs.start``)

    async def until_handoff(self) -> None:
        """The pair's prefill task: the prefill engine's stream to its handoff."""
        first = self.first_token
        try:
            async for ids in self.tokens():
                if self.first_ids is None:
                    self.first_ids, self.first_arrival_s = ids, self._call.last_arrival_s
                    first.set_result(None)
        finally:
            if not first.done():
                first.set_result(None)

    def _stage(self) -> str:
        return "before_handoff"

    def _record_end(self, t: pb.Timings) -> None:
        self._timings.observe("kv_transfer", t.kv_transfer_s)


class DecodeLeg(Leg):
    kind = "decode"
    PREFILLS_PROMPT = False

    def _record_first(self, t: pb.Timings) -> None:
        """The decode engine's first token: how long it waited for the KV, then for a step."""
        self._timings.observe("decode_wait", t.kv_wait_s)
        self._timings.observe("decode_queue", t.decode_queue_s)


class PairedLegs:
    """A PD attempt: P runs in a task to its handoff; D is streamed. Until D's first
    message (D waits for P's KV) the pair watches both: P's failure then is the
    attempt's; P's first token is handed on as soon as P's message of it is in, and
    D's copy dropped; D's first token, when D's message comes first, is handed on
    after P's message of it when P was asked for logprobs (they are P's)."""

    def __init__(self, prefill: PrefillLeg, decode: DecodeLeg) -> None:
        self.prefill = prefill
        self.decode = decode
        self._prefill_task: asyncio.Task | None = None
        self._decode_first: asyncio.Future | None = None  # D's first ids, while awaited
        self._from_prefill = False  # the ids last handed on were P's first token

    @property
    def finish_reason(self) -> str | None:
        return self.decode.finish_reason

    @property
    def prompt_logprobs(self) -> list[pb.TokenLogprob] | None:
        return self.prefill.prompt_logprobs

    def take_logprobs(self) -> list[pb.TokenLogprob]:
        """P's first token's entry (until taken), then D's."""
        return self.prefill.take_logprobs() + self.decode.take_logprobs()

    @property
    def arrival_s(self) -> float:
        if self._from_prefill:
            return self.prefill.first_arrival_s
        return self.decode.arrival_s

    @property
    def last_arrival_s(self) -> float:
        return self.decode.last_arrival_s or self.prefill.first_arrival_s

    @property
    def has_token(self) -> bool:
        return self.decode.has_token

    @property
    def has_pending_report(self) -> bool:
        """P's stream has not ended yet: its report may not be in the timings."""
        task = self._prefill_task
        return task is not None and not task.done()

    async def wait_report(self) -> None:
        """Called by ``RequestRun`` once D finished, before the answer ends: until P's
        stream ended too (its report read), for at most ``REPORT_WAIT_S``. P failing
        now changes nothing in the answer (``close`` retrieves it)."""
        await asyncio.wait((self._prefill_task,), timeout=REPORT_WAIT_S)

    def stream_engine(self) -> EngineEndpoint | None:
        """D, once the stream began: before, D waits for P's KV (moved only as a whole)."""
        return self.decode.stream_engine() if self.decode.has_token else None

    def interrupt(self) -> EngineEndpoint | None:
        return self.decode.interrupt() if self.decode.has_token else None

    def start(self, timeout_s: float, collects: bool = False) -> None:
        self.decode.start(timeout_s, collects)
        self.prefill.start(timeout_s)
        loop = self._loop = asyncio.get_running_loop()
        self.prefill.first_token = loop.create_future()
        self._prefill_task = loop.create_task(self.prefill.until_handoff())

    def tokens(self) -> AsyncIterator[list[int]]:
        """D's tokens, P's first one among them when P's message of it came first: the
        race until D's first message (``_first_tokens``), then D's own stream, whose
        tokens are handed out as they come (no generator of the pair's around each)."""
        stream = self.decode.tokens()
        return _Chain(self._first_tokens(stream), stream)

    async def _first_tokens(self, stream: AsyncIterator[list[int]]) -> AsyncIterator[list[int]]:
        decode, prefill, task = self.decode, self.prefill, self._prefill_task
        first = self._decode_first = self._loop.create_task(_next(stream))
        news: asyncio.Future | None = None  # awaited: done by D's first ids, P's first
        # token or P's end (a future, not an Event: an Event's first wait takes a lock)

        def wake(_: asyncio.Future) -> None:
            if news is not None and not news.done():
                news.set_result(None)

        for future in (first, prefill.first_token, task):
            future.add_done_callback(wake)
        while not first.done():  # D waits for P's KV: watch P too
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise self._prefill_failure(task.exception())  # before D's KV: the attempt's
            if not decode.has_token and prefill.first_ids is not None:
                decode.has_token = self._from_prefill = True  # a failure now is mid-stream
                yield prefill.first_ids
                continue
            news = self._loop.create_future()
            await news
        self._decode_first = None
        ids = first.result()  # D's failure, raised; None: D ended without a token
        if ids is None:
            return
        if self._from_prefill:  # P's first token went out: D's first is it
            del ids[:1]
            self._from_prefill = False
        elif prefill.wants_logprobs:
            await self._prefill_first_token()
        if ids:
            yield ids

    async def _prefill_first_token(self) -> None:
        """D's first token came first and P was asked for logprobs: until P's message of
        it (its logprobs) is in; P's stream ending without it is P's failure."""
        prefill, task = self.prefill, self._prefill_task
        if prefill.first_ids is None:
            await asyncio.wait((prefill.first_token, task), return_when=asyncio.FIRST_COMPLETED)
        if prefill.first_ids is not None:
            return
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise self._prefill_failure(task.exception())
        raise prefill._failure("no_first_token", "stream ended without the first token")

    def _prefill_failure(self, exc: BaseException) -> BaseException:
        """P relays D's "decode full" when D gave up reserving blocks for the transfer:
        that is D's load, so it is reported as D's (without D's address)."""
        if isinstance(exc, EngineFull) and exc.leg == "prefill" \
                and exc.details.startswith("decode full"):
            return EngineFull(self.decode.engine, "decode", "decode full")
        return exc

    def close(self) -> None:
        first = self._decode_first
        if first is not None:  # the attempt ended before D's first message
            if first.done():
                _retrieve(first)
            else:
                first.cancel()
        self.decode.close()
        task = self._prefill_task
        if task is None:
            self.prefill.close()
        elif task.done():
            _retrieve(task)  # a P failure after D's first token is moot
            self.prefill.release()
        elif self.decode.finished:
            self.prefill.release()
            task.add_done_callback(_retrieve)
        else:
            task.cancel()
            self.prefill.close()


class _Chain:
    """``head``'s items, then ``tail``'s, as one async iterator; once ``head`` is done,
    each step is ``tail``'s own (one call, no coroutine of its own per item)."""

    __slots__ = ("_head", "_tail")

    def __init__(self, head: AsyncIterator, tail: AsyncIterator) -> None:
        self._head, self._tail = head, tail

    def __aiter__(self) -> _Chain:
        return self

    def __anext__(self):
        if self._head is None:
            return self._tail.__anext__()
        return self._from_head()

    async def _from_head(self):
        try:
            return await self._head.__anext__()
        except StopAsyncIteration:
            self._head = None
            return await self._tail.__anext__()


async def _next(stream: AsyncIterator[list[int]]) -> list[int] | None:
    """The next ids of ``stream``, None at its end (a task's result)."""
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


def _retrieve(task: asyncio.Future) -> None:
    """Done callback of a prefill leg left to end by itself: its outcome no longer matters."""
    if not task.cancelled():
        task.exception()


class Aborter:
    """Background Abort RPCs; one per app. ``close`` waits for those still running."""

    def __init__(self, registry: InstanceRegistry) -> None:
        self.registry = registry
        self._tasks: set[asyncio.Task] = set()

    def abort_soon(self, engine: EngineEndpoint, request_id: str) -> None:
        """Called by ``Leg.close`` when a leg ended without finishing."""
        task = asyncio.get_running_loop().create_task(self._abort(engine.address, request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abort(self, address: str, request_id: str) -> None:
        try:
            await asyncio.wait_for(self.registry.engine(address).abort(request_id), ABORT_TIMEOUT_S)
        except (EngineCallError, TimeoutError) as exc:
            log.info("abort of %s on %s not confirmed: %s", request_id, address, type(exc).__name__)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
