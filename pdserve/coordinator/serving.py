"""The completion endpoints' work: prompt to tokens, run the request, shape OpenAI output.

``Completions.handle`` is called for the two completion routes (``front.py``). It
validates what pydantic cannot (model name, prompt length, the client's
``x-request-id``), takes an admission slot, and returns a JSON response or an SSE
stream. A stream's first
token is awaited before the response starts, so errors before it (no route, bad
prompt) get their real HTTP status; errors after it end the stream with an OpenAI
error event and ``data: [DONE]``.

Deadlines (``deadlines.py``) are fixed at arrival: the settings' first-token and idle
bounds, and a total when the settings or the client set one (the body's
``request_timeout`` or the ``x-request-timeout`` header, in seconds; the smallest
applies; anything but a number of at least 1 is a 400). The admission wait counts
against the first token's.

Ids: every request gets the Coordinator's own id (``lifecycle.new_request_id``): the
response's ``id`` and its engines' request id. A client's ``x-request-id`` (1-128
visible ASCII characters, else 400) is a label only: echoed in the response header,
in the timings and the logs. Timings name the engines only for the admin key
(``guard.ADMIN_SCOPE_KEY``).

The answer itself (JSON or SSE, one choice or several) is built in ``output.py``.

Invariants: the admission slot is released and the request counted exactly once,
whatever ends the request (a refusal before it was admitted, a ``ServeError`` not
``is_counted``, is counted where it is answered, ``app.Rejections``); a client that
goes away (stream or not) closes the run, which cancels and aborts both legs, is counted
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

from pdserve.api.sampling import SamplingParams

from .admission import Admission
from .deadlines import TIMEOUT_HEADER, Deadlines, client_total_s
from .errors import ServeError
from .guard import ADMIN_SCOPE_KEY
from .http_server import CLIENT_HOOK, JSONAnswer
from .lifecycle import Deps, RequestRun, new_request_id
from .logprobs import OutputLogprobs, TokenTexts
from .output import Choices, Output, sse_event
from .prompts import PromptBuilder
from .schemas import ChatCompletionRequest, CompletionRequest, StreamOptions, build_usage
from .settings import CoordinatorSettings
from .structured import output_format, template_messages

log = logging.getLogger(__name__)
TIMINGS_HEADER = "x-pdserve-timings"
REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID, _TIMINGS, _TIMEOUT = (REQUEST_ID_HEADER.encode(), TIMINGS_HEADER.encode(),
                                   TIMEOUT_HEADER.encode())
MAX_CLIENT_ID_CHARS = 128
# A chat's max_tokens when it gives none: past any engine's capacity, so the engine
# ends it at its context limit; fits the wire's int32.
UNTIL_CONTEXT_LIMIT = 1 << 30
_CLIENT_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_CLIENT_ID_CHARS}}}")  # visible ASCII, no spaces


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def client_request_id(given: bytes | None) -> str | None:
    """The client's ``x-request-id`` label (``given``: the header's value), None when it
    sent none; 400 when it is not 1-128 visible ASCII characters (it goes into headers
    and log lines as it is)."""
    if not given:
        return None
    text = given.decode("latin-1")
    if _CLIENT_ID.fullmatch(text) is None:
        raise ServeError(400, f"x-request-id must be 1-{MAX_CLIENT_ID_CHARS} visible ASCII "
                         f"characters without spaces (got {len(text)} characters)",
                         code="invalid_request_id", param=REQUEST_ID_HEADER)
    return text


def _request_headers(scope) -> tuple[bytes | None, bytes | None, bytes | None]:
    """(``x-request-id``, ``x-pdserve-timings``, ``x-request-timeout``) as sent, each
    None when absent: one pass over the request's headers (lower-case names, as ASGI
    gives them)."""
    given = timings = timeout = None
    for name, value in scope["headers"]:
        if name == _REQUEST_ID and given is None:
            given = value
        elif name == _TIMINGS and timings is None:
            timings = value
        elif name == _TIMEOUT and timeout is None:
            timeout = value
    return given, timings, timeout


def build_generation_params(body: CompletionRequest | ChatCompletionRequest,
                            settings: CoordinatorSettings,
                            vocab_size: int | None = None,
                            guided: tuple[str, str] | None = None) -> SamplingParams:
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
    return SamplingParams(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=seed,
        stop=body.stop_list(), ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
        top_k=max(0, body.top_k), min_p=body.min_p,
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


class DisconnectWatch:
    """While open, cancels the task that opened it when the client goes away; ``gone``
    says whether that is why the task was cancelled. Used as ``with
    DisconnectWatch(scope, receive) as watch:`` around the work. Served by the
    Coordinator's protocol, the request's ``ClientHook`` calls it (no task per
    request); elsewhere one watcher task waits on ``receive``."""

    __slots__ = ("gone", "_task", "_watch", "_hook", "_is_open")

    def __init__(self, scope, receive, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """``loop``: the running loop, when the caller has it."""
        loop = loop or asyncio.get_running_loop()
        self.gone = False
        self._task = asyncio.current_task(loop)
        self._is_open = True
        self._watch = None
        self._hook = hook = scope.get(CLIENT_HOOK)
        if hook is None:
            self._watch = loop.create_task(self._wait(receive))
        elif hook.is_gone:
            self._on_gone()
        else:
            hook.callback = self._on_gone

    async def _wait(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._on_gone()

    def _on_gone(self) -> None:
        if self._is_open:
            self.gone = True
            self._task.cancel()

    def __enter__(self) -> DisconnectWatch:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        self._is_open = False
        if self._watch is not None:
            self._watch.cancel()
        else:
            self._hook.callback = None
        if self.gone and kind is not None and issubclass(kind, asyncio.CancelledError):
            self._task.uncancel()
            raise ClientGone from None
        return False


def _watch(request: Request, loop, watch: bool):
    """A ``DisconnectWatch`` of ``request``, or nothing when its caller watches."""
    return DisconnectWatch(request.scope, request.receive, loop) if watch else contextlib.nullcontext()


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

    async def handle(self, request: Request, body, endpoint: str,
                     loop: asyncio.AbstractEventLoop | None = None, watch: bool = True) -> Response:
        """Called by the front for /v1/completions and /v1/chat/completions; ``loop``: the
        running loop, when the caller has it. ``watch``: this call watches for the
        client's going away (a batch's prompts are watched by the batch)."""
        if endpoint == "completions" and (prompts := body.batch()) is not None:
            if len(prompts) == 1:  # as lm-eval sends one prompt: the same as without the list
                body = body.model_copy(update={"prompt": prompts[0]})
            else:
                return await self._handle_batch(request, body, prompts, loop)
        arrival = time.monotonic()
        settings = self.deps.settings
        if body.model != settings.model_name:
            raise ServeError(404, f"model {body.model!r} does not exist; this server serves "
                             f"{settings.model_name!r}", code="model_not_found", param="model")
        given_id, timings_header, timeout_header = _request_headers(request.scope)
        label = client_request_id(given_id)
        deadlines = Deadlines.at_arrival(arrival, settings,
                                         client_total_s(timeout_header, body.request_timeout))
        fmt = output_format(body)  # structured output and tools: 400 before routing
        prompt_ids = self._prompt_ids(body, fmt.tools)
        params = build_generation_params(body, settings, self.prompts.vocab_size, fmt.guided)
        check_context_length(body, len(prompt_ids), params.max_tokens,
                             self.deps.registry.max_model_len())
        num_choices = choice_counts(body)
        slot = await self.admission.acquire(deadlines.first_token_s)
        request_id = new_request_id()
        echo = self._echo_text(body, prompt_ids)

        def output(index: int) -> Output:
            """Choice ``index``'s run and output; choice i > 0 samples from seed + i."""
            choice_params = params
            if index:
                choice_params = dataclasses.replace(
                    params, seed=None if params.seed is None else params.seed + index)
            if num_choices[1] > num_choices[0]:  # best_of ranks choices by their logprobs
                choice_params = dataclasses.replace(choice_params, logprobs=True)
            run = RequestRun(self.deps, request_id if not index else f"{request_id}-{index}",
                             prompt_ids, choice_params, deadlines, arrival, label)
            logprobs = None if not choice_params.logprobs else OutputLogprobs(
                run, self.token_texts, endpoint == "chat", params.top_logprobs,
                echo if params.prompt_logprobs else None)
            out = Output(run, body, endpoint, self.prompts.detokenizer(params.stop),
                          self.deps.metrics, self.admission, want_timings,
                          request.scope.get(ADMIN_SCOPE_KEY, False), echo, logprobs, index)
            out.shape = fmt.wrap(out.shape)
            return out

        want_timings = timings_header == b"1"
        out = output(0)
        run = out.run
        headers = {REQUEST_ID_HEADER: run.label}
        # One choice is its own answer; several are answered together (``Choices``).
        answer = out if num_choices[1] == 1 else Choices(
            out, [output(i) for i in range(1, num_choices[1])], num_choices[0], params.logprobs)
        try:
            if body.stream:
                with _watch(request, loop, watch):  # the client gone: ClientGone
                    first = await out.next_event()
                stream = StreamingResponse(answer.sse(first, slot),
                                           media_type="text/event-stream", headers=headers)
                stream.label = run.label
                return stream
            with _watch(request, loop, watch):
                await answer.collect()
            answer.done(200)
            slot.release()
            return JSONAnswer(orjson.dumps(answer.full_body()), run.label)
        except ClientGone:
            out.client_gone()
            await answer.end(slot, 499)
            gone = Response(status_code=499, headers=headers)
            gone.label = run.label
            return gone
        except BaseException as exc:
            await answer.end(slot, exc.status if isinstance(exc, ServeError) else 499)
            if isinstance(exc, ServeError):
                exc.headers.setdefault(REQUEST_ID_HEADER, run.label)
                exc.request_id = run.request_id
                exc.is_counted = True
            raise

    async def _handle_batch(self, request: Request, body: CompletionRequest, prompts: list,
                            loop: asyncio.AbstractEventLoop | None) -> Response:
        """A list of prompts: each answered as its own request, concurrently (the engines
        batch them), as one response as vLLM gives it: prompt i's ``n`` choices at
        indices ``i * n`` on, usage summed; streamed, every prompt's chunks as they come
        (``_merged_streams``). The first failure before any answer answers for the
        whole request (the other prompts are cancelled)."""
        if body.stream:  # each prompt's stream ends with its usage, summed into one
            options = StreamOptions(include_usage=True, continuous_usage_stats=bool(
                body.stream_options and body.stream_options.continuous_usage_stats))
            subs = [body.model_copy(update={"prompt": p, "stream_options": options})
                    for p in prompts]
        else:
            subs = [body.model_copy(update={"prompt": p}) for p in prompts]
        tasks: list[asyncio.Task] = []
        try:
            with DisconnectWatch(request.scope, request.receive, loop):
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(self.handle(request, sub, "completions", loop, False))
                             for sub in subs]
        except (ClientGone, ExceptionGroup) as exc:
            if body.stream:  # the streams that began hold their slots until they end
                for task in tasks:
                    if task.done() and not task.cancelled() and task.exception() is None:
                        await _end_stream(task.result().body_iterator)
            if isinstance(exc, ClientGone):
                return Response(status_code=499)
            raise exc.exceptions[0] from None  # the first prompt that failed answers for all
        answers = [t.result() for t in tasks]
        if body.stream:
            asked = body.stream_options is not None and body.stream_options.include_usage
            stream = StreamingResponse(
                _merged_streams([a.body_iterator for a in answers], body.n, asked),
                media_type="text/event-stream", headers={REQUEST_ID_HEADER: answers[0].label})
            stream.label = answers[0].label
            return stream
        bodies = [orjson.loads(a.body) for a in answers]
        choices = [{**c, "index": i * body.n + c["index"]}
                   for i, one in enumerate(bodies) for c in one["choices"]]
        usage = build_usage(*(sum(b["usage"][k] for b in bodies)
                              for k in ("prompt_tokens", "completion_tokens")),
                            sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies))
        label = answers[0].label
        return JSONAnswer(orjson.dumps({**bodies[0], "choices": choices, "usage": usage}), label)

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


async def _end_stream(body) -> None:
    """Ends a stream no one will read: started (its first event was ready) and closed,
    so its own ``finally`` counts it and releases its slot."""
    with contextlib.suppress(StopAsyncIteration):
        await body.__anext__()
    await body.aclose()


async def _merged_streams(bodies: list, n: int, include_usage: bool):
    """The SSE body of a streamed list of prompts: each prompt's chunks as they come,
    under the first prompt's id, its choices indexed ``i * n`` on; each prompt's usage
    chunk summed into one at the end (when asked for); a prompt's error event ends the
    whole stream (the others are closed); then ``[DONE]``."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, body) -> None:
        try:
            async for event in body:
                await queue.put((i, event))
        finally:
            await queue.put((i, None))

    pumps = [asyncio.ensure_future(pump(i, body)) for i, body in enumerate(bodies)]
    first_id, usage, open_ = None, [], len(bodies)
    try:
        while open_:
            i, event = await queue.get()
            if event is None:
                open_ -= 1
                continue
            payload = event.removeprefix(b"data: ").strip()
            if payload == b"[DONE]":
                continue
            chunk = orjson.loads(payload)
            if "error" in chunk:
                yield event
                return
            if chunk.get("usage") and not chunk.get("choices"):
                usage.append(chunk)
                continue
            first_id = first_id or chunk["id"]
            chunk["id"] = first_id
            for choice in chunk.get("choices", ()):
                choice["index"] += i * n
            yield sse_event(chunk)
        if include_usage and usage:
            counts = [u["usage"] for u in usage]
            total = build_usage(sum(u["prompt_tokens"] for u in counts),
                                sum(u["completion_tokens"] for u in counts),
                                sum(u["prompt_tokens_details"]["cached_tokens"] for u in counts))
            yield sse_event({**usage[0], "id": first_id or usage[0]["id"], "usage": total})
        yield b"data: [DONE]\n\n"
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for body in bodies:
            await body.aclose()
