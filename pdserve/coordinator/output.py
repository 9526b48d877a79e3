"""What a request sends back: its OpenAI JSON or SSE stream, one choice or several.

``Output`` accumulates one choice's tokens (text, logprobs, timings) from its
``RequestRun`` and renders it; ``Choices`` runs the choices of a request with ``n``
or ``best_of`` above 1 together; ``sse_body`` is the stream framing both use. Built
and driven by ``serving.Completions.handle`` on the event loop, within the request.

SSE: each event is one ``data:`` line; U+2028, U+2029 and U+0085, which JSON allows
raw but line splitters such as Python's ``str.splitlines`` break lines at, are
written escaped. Errors after the stream started end it with an OpenAI error event
and ``data: [DONE]``.

Invariants: a request is counted once (``Output.done``; choice 0 counts it, the
others add their tokens), its admission slot released once, its runs closed
whatever ends the stream.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from pdserve.runtime.detokenizer import Detokenizer

from .admission import Admission
from .errors import ServeError
from .lifecycle import RequestRun
from .logprobs import OutputLogprobs
from .metrics import CoordinatorMetrics
from .schemas import ChatCompletionRequest, CompletionRequest, ResponseBuilder, build_usage

log = logging.getLogger(__name__)


class Output:
    """Accumulates one request's output and renders it as OpenAI JSON or SSE chunks.
    Built by ``Completions.handle``; runs on the event loop, within the request."""

    def __init__(self, run: RequestRun, body: CompletionRequest | ChatCompletionRequest,
                 endpoint: str, detok: Detokenizer, metrics: CoordinatorMetrics,
                 admission: Admission, want_timings: bool, is_admin: bool = False,
                 echo: str | None = None, logprobs: OutputLogprobs | None = None,
                 index: int = 0) -> None:
        self.run, self.body, self.endpoint, self.detok = run, body, endpoint, detok
        self.index = index  # the choice; choice 0 counts the request (``done``)
        self.echo = echo  # a completion's prompt text, before its output
        self.logprobs = logprobs
        self.metrics = metrics
        self._itl = metrics.itl  # observed per token
        self.admission = admission
        self.want_timings = want_timings
        self.is_admin = is_admin
        response_id = run.request_id.rsplit("-", 1)[0] if index else run.request_id
        if endpoint == "chat":  # OpenAI's: chatcmpl-...; the Coordinator's own id is cmpl-...
            response_id = "chat" + response_id
        self.shape = ResponseBuilder(response_id, body.model, int(time.time()), endpoint == "chat", index)
        self.text: list[str] = []
        self.first_s: float | None = None
        self.last_s: float | None = None
        self.finish_reason: str | None = None
        self._tokens = run.tokens()
        self._has_first_decode = False
        self._counted = False

    async def next_event(self) -> tuple[list[int], str] | None:
        """Next (token ids, released text), or None at the end (finish_reason set)."""
        if self.finish_reason is not None:
            return None
        ids = await self._next_ids()
        if ids is None:
            tail = self.detok.flush()
            return ([], tail) if tail else None
        new_text, hit_stop = self.detok.append(ids)
        if hit_stop:
            self.finish_reason = "stop"
            await self.close()
            self.metrics.aborts.labels("stop_string").inc()
        return ids, new_text

    async def _next_ids(self) -> list[int] | None:
        """The next message's token ids, their arrival observed (first token, gaps); None
        once the run has ended (``finish_reason`` set)."""
        try:
            ids = await self._tokens.__anext__()
        except StopAsyncIteration:
            self.finish_reason = self.run.finish_reason or "length"
            return None
        run = self.run
        # A collected answer's messages are read at its end: each is timed by its arrival.
        now = run.last_tokens_s if run.collects else time.monotonic()
        if self.first_s is None:
            self.first_s = now
        else:
            if not self._has_first_decode:
                self._has_first_decode = True
                run.timings.observe("first_decode", now - self.first_s)
            self._itl.observe(now - self.last_s)
        self.last_s = now
        return ids

    async def collect(self) -> None:
        """The whole answer, not streamed. Without stop strings nothing needs its text
        before the end, so it is decoded once from all its tokens (the same text as
        decoding message by message) instead of per message, and nothing needs the
        engine's messages after the first before the last: the run's legs hold them and
        hand them on together (``RequestRun.collects``), each timed by its arrival."""
        if self.detok.stop:
            while (event := await self.next_event()) is not None:
                self.text.append(event[1])
            return
        ids: list[int] = []
        self.run.collects = True
        while self.finish_reason is None and (more := await self._next_ids()) is not None:
            ids += more
        self.text.append(self.detok.append(ids)[0] + self.detok.flush())

    async def close(self) -> None:
        await self._tokens.aclose()

    async def end(self, slot, code: int) -> None:
        """A request that ends before its response: counted, slot released, run closed."""
        self.done(code)
        slot.release()
        await self.close()

    def usage(self) -> dict:
        return build_usage(len(self.run.prompt_ids), len(self.detok.token_ids),
                           int(self.run.timings.report.get("cached_tokens") or 0))

    def client_gone(self) -> None:
        """Called when the client left before the end of its answer (before it, or
        mid-stream): counted and logged at DEBUG."""
        self.metrics.aborts.labels("client_gone").inc()
        log.debug("client of %s went away before the end of its answer", self.run.label,
                  extra={"request_id": self.run.label})

    def done(self, code: int) -> None:
        """Counts the request once and observes its latency histograms."""
        if self._counted:
            return
        self._counted = True
        m = self.metrics
        if self.index:  # another choice of a request choice 0 counts
            if code == 200:
                m.generation_tokens.inc(len(self.detok.token_ids))
            return
        m.requests.labels(self.endpoint, str(code)).inc()
        end = time.monotonic()
        arrival = self.run.arrival_s
        self.admission.observe_duration(end - arrival)
        t = self.run.timings.report
        t["e2e_s"] = end - arrival
        if code != 200:
            return
        n_out = len(self.detok.token_ids)
        m.prompt_tokens.inc(len(self.run.prompt_ids))
        m.generation_tokens.inc(n_out)
        m.e2e.observe(end - arrival)
        if self.first_s is not None:
            t["ttft_s"] = self.first_s - arrival
            m.ttft.observe(t["ttft_s"])
            if n_out > 1:
                t["tpot_s"] = (self.last_s - self.first_s) / (n_out - 1)
                m.tpot.observe(t["tpot_s"])

    def _timings(self) -> dict | None:
        return self.run.timings.visible(self.is_admin) if self.want_timings else None

    def full_body(self) -> dict:
        token_ids = list(self.detok.token_ids) if self.body.return_token_ids else None
        logprobs = self.logprobs.take() if self.logprobs is not None else None
        return self.shape.response((self.echo or "") + "".join(self.text), self.finish_reason,
                                   self.usage(), token_ids, self._timings(), logprobs)

    async def chunks(self, first, usage=None, on_end=None):
        """This choice's stream chunks, the last one with its ``finish_reason``; ``first``
        is its first event, awaited before the response started (None: not yet read).
        ``usage()`` is what ``continuous_usage_stats`` puts in each chunk; ``on_end()``
        runs before the last chunk is built (it counts the request, timings included)."""
        with_ids = self.body.return_token_ids
        options = self.body.stream_options
        continuous_usage = options is not None and options.continuous_usage_stats
        usage = usage or self.usage
        event, is_first = first if first is not None else await self.next_event(), True
        while event is not None:
            ids, text = event
            has_logprobs = self.logprobs is not None and ids
            if text or is_first or (with_ids and ids) or has_logprobs:
                if is_first and self.echo:
                    text = self.echo + text
                chunk = self.shape.chunk(text, is_first, token_ids=ids if with_ids else None,
                                         logprobs=self.logprobs.take() if has_logprobs else None)
                if chunk is not None:  # None: a tool call's text held back (structured.py)
                    if continuous_usage:
                        chunk["usage"] = usage()
                    yield chunk
                is_first = False
            event = await self.next_event()
        if on_end is not None:
            on_end()
        last = self.shape.chunk("", finish_reason=self.finish_reason,
                                timings=self._timings() if not self.index else None)
        if continuous_usage:
            last["usage"] = usage()
        yield last

    def sse(self, first, slot):
        """The SSE body; ``first`` is the event awaited before the response started.
        (``sse_body`` itself, not a generator around it: one layer less per token.)"""
        return sse_body(self, self, self.chunks(first, on_end=lambda: self.done(200)), slot)


async def sse_body(answer, primary: Output, chunks, slot):
    """The framing of a stream, one choice's (``answer`` is ``primary``) or several
    (``Choices``): each chunk as an event, the usage chunk when asked for, an error
    event for a ``ServeError``, then ``[DONE]``; counted, released and closed once,
    whatever ends it (a client that went away: 499, counted as gone)."""
    code = 200
    options = primary.body.stream_options
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
        answer.done(200)
        if options is not None and options.include_usage:
            yield sse_event(primary.shape.usage_chunk(answer.usage()))
    except ServeError as exc:
        code = exc.status
        yield _sse_data(exc.json_bytes())
    except BaseException:  # the response was cancelled: the client went away
        code = 499
        if not primary._counted:
            primary.client_gone()
        raise
    finally:
        answer.done(code)
        slot.release()
        await answer.close()
    yield b"data: [DONE]\n\n"


class Choices:
    """The choices of one request with ``n`` or ``best_of`` above 1: each an ``Output``
    with its own run (choice i samples from seed + i), streamed or collected together;
    choice 0 counts the request. The others start once choice 0 has its first token, so
    their prefills find the prompt's blocks in its engines' prefix caches (same plan:
    ``Router.plan(prefer=)``); each continues on its own after a failure."""

    def __init__(self, first: Output, others: list[Output], num_returned: int,
                 want_logprobs: bool) -> None:
        self.outs = [first, *others]
        self.num_returned = num_returned
        self.want_logprobs = want_logprobs
        self._tasks: list[asyncio.Future] = []

    def _others(self, work):
        primary = self.outs[0]
        for out in self.outs[1:]:
            out.run.prefer = primary.run.plan
        return [asyncio.ensure_future(work(out)) for out in self.outs[1:]]

    async def _all(self, tasks: list[asyncio.Future]) -> None:
        self._tasks = tasks
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()

    async def collect(self) -> None:
        primary = self.outs[0]
        first = await primary.next_event()
        if first is not None:
            primary.text.append(first[1])
        await self._all([asyncio.ensure_future(primary.collect()),
                         *self._others(lambda out: out.collect())])

    def usage(self) -> dict:
        num_out = sum(len(out.detok.token_ids) for out in self.outs)
        primary = self.outs[0]
        return build_usage(len(primary.run.prompt_ids), num_out,
                           int(primary.run.timings.report.get("cached_tokens") or 0))

    def done(self, code: int) -> None:
        for out in self.outs:
            out.done(code)

    async def end(self, slot, code: int) -> None:
        self.done(code)
        slot.release()
        await self.close()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for out in self.outs:
            await out.close()

    def full_body(self) -> dict:
        """The response: the ``n`` choices (the ``n`` of ``best_of`` with the highest total
        logprob, which they carry only when asked for), usage summed over all sampled."""
        outs = self.outs
        if self.num_returned < len(outs):
            outs = sorted(outs, key=lambda o: -sum(e.logprob for e in o.run.logprobs))
            outs = outs[:self.num_returned]
        bodies = [out.full_body() for out in outs]
        body = {**self.outs[0].full_body(), "usage": self.usage()}
        body["choices"] = []
        for index, one in enumerate(bodies):
            choice = {**one["choices"][0], "index": index}
            if not self.want_logprobs:
                choice["logprobs"] = None
            body["choices"].append(choice)
        return body

    def sse(self, first, slot):
        """The SSE body: every choice's chunks as they come (each with its index), then
        the summed usage and ``[DONE]``; ``first`` is choice 0's first event."""
        return sse_body(self, self.outs[0], self._chunks(first), slot)

    async def _chunks(self, first):
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(out: Output, event=None) -> None:
            async for chunk in out.chunks(event, self.usage):
                await queue.put(chunk)

        tasks = [asyncio.ensure_future(pump(self.outs[0], first)),
                 *self._others(lambda out: pump(out))]
        self._tasks = tasks
        waiting = set(tasks)
        while waiting:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, *waiting}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield getter.result()
            else:
                getter.cancel()
            for task in done - {getter}:
                waiting.discard(task)
                if task.exception() is not None:
                    raise task.exception()
        while not queue.empty():
            yield queue.get_nowait()


# UTF-8 of U+2028, U+2029 and U+0085, and their JSON escapes. A lead byte never
# occurs inside another character, so replacing the bytes is exact.
_LINE_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def _sse_data(payload: bytes) -> bytes:
    """One SSE event of a JSON ``payload``, with the line breaks JSON leaves raw escaped."""
    if b"\xe2\x80" in payload or b"\xc2\x85" in payload:
        for raw, escaped in _LINE_BREAKS:
            payload = payload.replace(raw, escaped)
    return b"data: " + payload + b"\n\n"


def sse_event(body: dict) -> bytes:
    """One SSE event of ``body`` (JSON)."""
    return _sse_data(orjson.dumps(body))
