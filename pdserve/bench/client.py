"""The HTTP side: one streamed ``/v1/completions`` request in, one ``RequestResult`` out.

Owns the request body, SSE parsing and the per-chunk timestamps. Works against any
OpenAI-compatible server. Every request asks for a fixed output length
(``max_tokens`` with ``min_tokens`` = ``max_tokens`` and ``ignore_eos``; servers that
ignore the two extensions still work, their short answers are counted in
``num_short``), streams with ``stream_options.include_usage`` (the final usage is the
output-token count) and asks for ``return_token_ids`` (pdserve and vLLM), so a chunk
says how many tokens it carries; without it each chunk with text counts as one.

Invariants: ``complete`` never raises for a failed request (the failure is in the
result); a chunk's time is taken with ``time.perf_counter`` as its line arrives,
before it is parsed.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import orjson

from .prompts import PlannedRequest
from .stats import RequestResult


def api_base(base_url: str) -> str:
    """``http://host:port``, ``.../v1`` or ``.../v1/`` -> ``http://host:port/v1``."""
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


class CompletionClient:
    """One shared connection pool for a run. Built and closed by the caller (``async with``)."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 300.0, temperature: float = 0.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = api_base(base_url)
        self.model = model
        self.temperature = temperature
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0), transport=transport,
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=1024))

    async def __aenter__(self) -> CompletionClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()

    async def discover_model(self) -> str:
        """The first model ``/v1/models`` lists, unless one was given."""
        if self.model is None:
            try:
                r = await self.http.get(f"{self.url}/models")
                r.raise_for_status()
                self.model = str(r.json()["data"][0]["id"])
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                raise ConnectionError(f"cannot list models at {self.url}/models "
                                      f"({type(exc).__name__}: {exc}); pass --model?") from None
        return self.model

    async def wait_until_serving(self, timeout_s: float) -> None:
        """Retry a one-token completion until it succeeds (a deployment that just came up)."""
        deadline, last = time.monotonic() + timeout_s, "no answer"
        probe = PlannedRequest("probe", "Hello", 1)
        while time.monotonic() < deadline:
            try:
                await self.discover_model()
                result = await self.complete(probe)
                if result.is_ok:
                    return
                last = f"{result.error} {result.error_detail}".strip()
            except (httpx.HTTPError, ConnectionError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.5)
        raise TimeoutError(f"{self.url} not serving after {timeout_s:g}s: {last}")

    def body(self, req: PlannedRequest) -> dict:
        return {"model": self.model, "prompt": req.prompt, "max_tokens": req.max_tokens,
                "min_tokens": req.max_tokens, "ignore_eos": True, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}

    async def complete(self, req: PlannedRequest) -> RequestResult:
        """Send one request and record it; called by the load generator, once per request."""
        result = RequestResult(req.class_name, req.max_tokens, start_s=time.perf_counter(),
                               planned_prompt_tokens=req.num_prompt_tokens)
        try:
            async with self.http.stream("POST", f"{self.url}/completions", json=self.body(req)) as r:
                if r.status_code != 200:
                    result.error = str(r.status_code)
                    result.error_detail = (await r.aread()).decode(errors="replace")[:300]
                else:
                    await self._read_stream(r, result)
        except httpx.TimeoutException:
            result.error = "timeout"
        except httpx.HTTPError as exc:
            result.error, result.error_detail = "connection", f"{type(exc).__name__}: {exc}"[:300]
        except (TypeError, AttributeError, ValueError) as exc:  # a chunk not shaped like OpenAI's
            result.error, result.error_detail = "bad_stream", f"{type(exc).__name__}: {exc}"[:300]
        result.end_s = time.perf_counter()
        if result.error is None and not result.chunk_times_s:
            result.error = "no_tokens"
        return result

    async def _read_stream(self, r: httpx.Response, result: RequestResult) -> None:
        async for line in r.aiter_lines():
            now = time.perf_counter()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                result.error, result.error_detail = "bad_stream", data[:300]
                return
            if "error" in chunk:
                result.error = "stream_error"
                result.error_detail = json.dumps(chunk["error"])[:300]
                return
            usage = chunk.get("usage")
            if usage:
                result.usage_prompt_tokens = usage.get("prompt_tokens")
                result.usage_output_tokens = usage.get("completion_tokens")
            num_tokens = 0
            for choice in chunk.get("choices") or ():
                if "token_ids" in choice and choice["token_ids"] is not None:
                    num_tokens += len(choice["token_ids"])
                elif choice.get("text"):
                    num_tokens += 1
                    result.has_exact_tokens = False
            if num_tokens:
                result.chunk_times_s.append(now)
                result.chunk_tokens.append(num_tokens)
