"""The completion endpoints' work: prompt to tokens, run the request, shape OpenAI output.

``Completions.handle`` is called by the app's two routes. It validates what pydantic
cannot (model name, prompt length, the client's ``x-request-id``), takes an
admission slot, and returns a JSON response or an SSE stream. A stream's first
token is awaited before the response starts, so errors before it (no route, bad
prompt) get their real HTTP status; errors after it end the stream with an OpenAI
error event and ``data: [DONE]``.

Ids: every request gets the Coordinator's own id (``lifecycle.new_request_id``): the
response's ``id`` and its engines' request id. A client's ``x-request-id`` (1-128
visible ASCII characters, else 400) is a label only: echoed in the response header,
in the timings and the logs. Timings name the engines only for the admin key
(``guard.ADMIN_SCOPE_KEY``).

SSE: each event is one ``data:`` line; U+2028, U+2029 and U+0085, which JSON allows
raw but line splitters such as Python's ``str.splitlines`` break lines at, are
written escaped.

Invariants: the admission slot is released and the request counted exactly once,
whatever ends the request (a refusal before it was admitted, a ``ServeError`` not
``is_counted``, is counted by the app's error handler); a client that goes away
(stream or not) closes the run, which cancels and aborts both legs, is counted
(``pdserve_coordinator_aborts_total{reason="client_gone"}``, and 499 in the requests)
and logged at DEBUG: it is the client's doing, not an error of the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import re
import time

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pdserve.runtime.detokenizer import Detokenizer

from .admission import Admission
from .errors import ServeError
from .guard import ADMIN_SCOPE_KEY
from .lifecycle import Deps, GenerationParams, RequestRun, new_request_id
from .logprobs import OutputLogprobs, TokenTexts
from .metrics import CoordinatorMetrics
from .prompts import PromptBuilder
from .schemas import ChatCompletionRequest, CompletionRequest, ResponseBuilder, build_usage
from .settings import CoordinatorSettings
from .structured import output_format, template_messages

log = logging.getLogger(__name__)
TIMINGS_HEADER = "x-pdserve-timings"
REQUEST_ID_HEADER = "x-request-id"
MAX_CLIENT_ID_CHARS = 128
# A chat's max_tokens when it gives none: past any engine's capacity, so the engine
# ends it at its context limit; fits the wire's int32.
UNTIL_CONTEXT_LIMIT = 1 << 30
_CLIENT_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_CLIENT_ID_CHARS}}}")  # visible ASCII, no spaces


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def client_request_id(request: Request) -> str | None:
    """The client's ``x-request-id`` label, None when it sent none; 400 when it is not
    1-128 visible ASCII characters (it goes into headers and log lines as it is)."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    if not given:
        return None
    if _CLIENT_ID.fullmatch(given) is None:
        raise ServeError(400, f"x-request-id must be 1-{MAX_CLIENT_ID_CHARS} visible ASCII "
                         f"characters without spaces (got {len(given)} characters)",
                         code="invalid_request_id", param=REQUEST_ID_HEADER)
    return given


def build_generation_params(body: CompletionRequest | ChatCompletionRequest,
                            settings: CoordinatorSettings,
                            vocab_size: int | None = None,
                            guided: tuple[str, str] | None = None) -> GenerationParams:
    """The request's sampling and limits, from its OpenAI body; called once by ``handle``.

    Without ``max_tokens``, a completion gets ``settings.max_tokens_default`` (16, as
    OpenAI's legacy completions) and a chat runs to the context limit, as OpenAI and
    vLLM do: ``UNTIL_CONTEXT_LIMIT``, which the engine cuts at its capacity ("length").
    ``logit_bias`` ids are checked against ``vocab_size`` where the Coordinator knows it
    (else by the engine)."""
    max_tokens = body.max_tokens or getattr(body, "max_completion_tokens", None)
    if max_tokens is None:
        is_chat = isinstance(body, ChatCompletionRequest)
        max_tokens = UNTIL_CONTEXT_LIMIT if is_chat else settings.max_tokens_default
    bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    for name, ids in (("logit_bias", bias), ("stop_token_ids", body.stop_token_ids)):
        bad = [t for t in ids if vocab_size is not None and t >= vocab_size]
        if bad:
            raise ServeError(400, f"{name}: token ids must be in [0, {vocab_size}), got {bad[:8]}",
                             param=name)
    # A sampled request without a seed gets one here, so that a stream continued
    # on another engine after a failure keeps drawing the same random numbers.
    seed = body.seed
    if seed is None and body.temperature:
        seed = random.getrandbits(62)
    if body.min_tokens > max_tokens:
        raise ServeError(400, f"min_tokens ({body.min_tokens}) must not exceed max_tokens "
                         f"({max_tokens})", param="min_tokens")
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs and not body.logprobs:
            raise ServeError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs, num_top, prompt_logprobs = body.logprobs, body.top_logprobs or 0, False
    else:
        logprobs, num_top = body.logprobs is not None, body.logprobs or 0
        prompt_logprobs = logprobs and body.echo
    return GenerationParams(
        max_tokens, body.temperature, body.top_p, seed, body.stop_list(), body.ignore_eos,
        body.min_tokens, top_k=max(0, body.top_k), min_p=body.min_p,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, logit_bias=bias,
        stop_token_ids=list(body.stop_token_ids), logprobs=logprobs, top_logprobs=num_top,
        prompt_logprobs=prompt_logprobs, guided=guided)


def check_context_length(body: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int,
                         max_tokens: int, max_model_len: int) -> None:
    """400 naming the numbers when the prompt, or the prompt plus the ``max_tokens``
    the client asked for, exceeds ``max_model_len`` (the engines' smallest; 0: not
    known yet, left to the engine). Without ``max_tokens`` the output is cut at the
    limit instead ("length")."""
    if not max_model_len:
        return
    if num_prompt_tokens >= max_model_len:
        raise ServeError(400, f"this model's maximum context length is {max_model_len} tokens; "
                         f"the prompt has {num_prompt_tokens} tokens", param="prompt",
                         code="context_length_exceeded")
    asked = body.max_tokens or getattr(body, "max_completion_tokens", None)
    if asked is not None and num_prompt_tokens + asked > max_model_len:
        raise ServeError(400, f"this model's maximum context length is {max_model_len} tokens; "
                         f"the prompt has {num_prompt_tokens} tokens and max_tokens asks for "
                         f"{asked} ({num_prompt_tokens + asked} in all)", param="max_tokens",
                         code="context_length_exceeded")


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Completions:
    def __init__(self, deps: Deps, prompts: PromptBuilder, admission: Admission) -> None:
        self.deps = deps
        self.prompts = prompts
        self.admission = admission
        self.token_texts = TokenTexts(prompts.tokenizer)

    def _prompt_ids(self, body: CompletionRequest | ChatCompletionRequest,
                    tools: list[dict] | None = None) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            messages = template_messages(body.messages)
            return self.prompts.encode_text(self.prompts.render_chat(messages, tools))
        if isinstance(body.prompt, str):
            ids = self.prompts.encode_text(body.prompt, add_bos=True)
        else:
            ids = self.prompts.check_ids(body.prompt)
        if not ids:
            raise ServeError(400, "the prompt is empty", param="prompt")
        return ids

    async def handle(self, request: Request, body, endpoint: str) -> Response:
        """Called by the app for /v1/completions and /v1/chat/completions."""
        arrival = time.monotonic()
        settings = self.deps.settings
        if body.model != settings.model_name:
            raise ServeError(404, f"model {body.model!r} does not exist; this server serves "
                             f"{settings.model_name!r}", code="model_not_found", param="model")
        label = client_request_id(request)
        fmt = output_format(body)  # structured output and tools: 400 before routing
        prompt_ids = self._prompt_ids(body, fmt.tools)
        params = build_generation_params(body, settings, self.prompts.vocab_size, fmt.guided)
        check_context_length(body, len(prompt_ids), params.max_tokens,
                             self.deps.registry.max_model_len())
        num_choices = choice_counts(body)
        deadline = arrival + settings.request_timeout_s
        slot = await self.admission.acquire(deadline)
        request_id = new_request_id()
        echo = self._echo_text(body, prompt_ids)

        def output(index: int) -> _Output:
            """Choice ``index``'s run and output; choice i > 0 samples from seed + i."""
            choice_params = params
            if index:
                choice_params = dataclasses.replace(
                    params, seed=None if params.seed is None else params.seed + index)
            if num_choices[1] > num_choices[0]:  # best_of ranks choices by their logprobs
                choice_params = dataclasses.replace(choice_params, logprobs=True)
            run = RequestRun(self.deps, request_id if not index else f"{request_id}-{index}",
                             prompt_ids, choice_params, deadline, arrival, label)
            logprobs = None if not choice_params.logprobs else OutputLogprobs(
                run, self.token_texts, endpoint == "chat", params.top_logprobs,
                echo if params.prompt_logprobs else None)
            out = _Output(run, body, endpoint, self.prompts.detokenizer(params.stop),
                          self.deps.metrics, self.admission, want_timings,
                          request.scope.get(ADMIN_SCOPE_KEY, False), echo, logprobs, index)
            out.shape = fmt.wrap(out.shape)
            return out

        want_timings = request.headers.get(TIMINGS_HEADER) == "1"
        out = output(0)
        run = out.run
        headers = {REQUEST_ID_HEADER: run.label}
        # One choice is its own answer; several are answered together (``Choices``).
        answer = out if num_choices[1] == 1 else Choices(
            out, [output(i) for i in range(1, num_choices[1])], num_choices[0], params.logprobs)
        try:
            if body.stream:
                first = await self._first(request, run, out)
                return StreamingResponse(answer.sse(first, slot), media_type="text/event-stream",
                                         headers=headers)
            await self._race_disconnect(request, answer.collect())
            answer.done(200)
            slot.release()
            return Response(orjson.dumps(answer.full_body()), media_type="application/json",
                            headers=headers)
        except ClientGone:
            out.client_gone()
            await answer.end(slot, 499)
            return Response(status_code=499, headers=headers)
        except BaseException as exc:
            await answer.end(slot, exc.status if isinstance(exc, ServeError) else 499)
            if isinstance(exc, ServeError):
                exc.headers.setdefault(REQUEST_ID_HEADER, run.label)
                exc.request_id = run.request_id
                exc.is_counted = True
            raise

    def _echo_text(self, body, prompt_ids: list[int]) -> str | None:
        """A completion's prompt text for ``echo`` (its token ids decoded when it came as
        ids); None without echo."""
        if not getattr(body, "echo", False):
            return None
        if isinstance(body.prompt, str):
            return body.prompt
        if self.prompts.tokenizer is None:
            raise ServeError(400, "echo of a token-id prompt needs the model's tokenizer",
                             param="echo")
        return self.prompts.tokenizer.decode(prompt_ids)

    async def _race_disconnect(self, request: Request, coro):
        """Awaits ``coro`` unless the client goes away first: then it is cancelled (its
        legs aborted) and ``ClientGone`` raised, which ``handle`` answers quietly."""
        work = asyncio.ensure_future(coro)
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
        if work.cancelled():
            raise ClientGone
        return work.result()

    async def _first(self, request: Request, run: RequestRun, out: _Output):
        return await self._race_disconnect(request, out.next_event())


class _Output:
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
        self.admission = admission
        self.want_timings = want_timings
        self.is_admin = is_admin
        self.shape = ResponseBuilder(run.request_id.rsplit("-", 1)[0] if index else run.request_id,
                                     body.model, int(time.time()), endpoint == "chat", index)
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
        try:
            ids = await self._tokens.__anext__()
        except StopAsyncIteration:
            self.finish_reason = self.run.finish_reason or "length"
            tail = self.detok.flush()
            return ([], tail) if tail else None
        now = time.monotonic()
        if self.first_s is None:
            self.first_s = now
        else:
            if not self._has_first_decode:
                self._has_first_decode = True
                self.run.timings.observe("first_decode", now - self.first_s)
            self.metrics.itl.observe(now - self.last_s)
        self.last_s = now
        new_text, hit_stop = self.detok.append(ids)
        if hit_stop:
            self.finish_reason = "stop"
            await self.close()
            self.metrics.aborts.labels("stop_string").inc()
        return ids, new_text

    async def collect(self) -> None:
        while (event := await self.next_event()) is not None:
            self.text.append(event[1])

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

    async def sse(self, first, slot):
        """The SSE body; ``first`` is the event awaited before the response started."""
        async for event in _sse_body(self, self, self.chunks(first, on_end=lambda: self.done(200)),
                                     slot):
            yield event


async def _sse_body(answer, primary: _Output, chunks, slot):
    """The framing of a stream, one choice's (``answer`` is ``primary``) or several
    (``Choices``): each chunk as an event, the usage chunk when asked for, an error
    event for a ``ServeError``, then ``[DONE]``; counted, released and closed once,
    whatever ends it (a client that went away: 499, counted as gone)."""
    code = 200
    options = primary.body.stream_options
    try:
        async for chunk in chunks:
            yield _sse(chunk)
        answer.done(200)
        if options is not None and options.include_usage:
            yield _sse(primary.shape.usage_chunk(answer.usage()))
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


def choice_counts(body: CompletionRequest | ChatCompletionRequest) -> tuple[int, int]:
    """(choices returned, choices sampled): ``n`` and ``best_of`` (which is at least
    ``n`` and not streamed, as OpenAI's)."""
    n, best_of = body.n, getattr(body, "best_of", None) or body.n
    if best_of < n:
        raise ServeError(400, f"best_of ({best_of}) must be at least n ({n})", param="best_of")
    if best_of > n and body.stream:
        raise ServeError(400, "best_of cannot be streamed (the best choices are known only "
                         "at the end)", param="best_of")
    return n, best_of


class Choices:
    """The choices of one request with ``n`` or ``best_of`` above 1: each an ``_Output``
    with its own run (choice i samples from seed + i), streamed or collected together;
    choice 0 counts the request. The others start once choice 0 has its first token, so
    their prefills find the prompt's blocks in its engines' prefix caches (same plan:
    ``Router.plan(prefer=)``); each continues on its own after a failure."""

    def __init__(self, first: _Output, others: list[_Output], num_returned: int,
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

    async def sse(self, first, slot):
        """The SSE body: every choice's chunks as they come (each with its index), then
        the summed usage and ``[DONE]``; ``first`` is choice 0's first event."""
        async for event in _sse_body(self, self.outs[0], self._chunks(first), slot):
            yield event

    async def _chunks(self, first):
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(out: _Output, event=None) -> None:
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


def _sse(body: dict) -> bytes:
    return _sse_data(orjson.dumps(body))
