"""A two-step P/D proxy for vLLM, the way vLLM's documentation has a user run its
NixlConnector: the baseline that ``benchmarks/vllm_pd_compare.py`` sets pdserve's
Coordinator against.

Each OpenAI request (``/v1/completions`` or ``/v1/chat/completions``) goes first to a
prefill vLLM with ``max_tokens: 1``, ``stream: false`` and ``kv_transfer_params:
{do_remote_decode: true}``; then the same request, with the ``kv_transfer_params`` that
P answered, to a decode vLLM, whose answer (streamed or not) is the client's. P and D
are taken round-robin. Nothing else: no health checks, no retries, no routing by load,
no first token from P; the client's first token is D's.

    python benchmarks/vllm_pd_proxy.py --port 9000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import itertools
import json

import aiohttp
from aiohttp import web


def make_app(prefill: list[str], decode: list[str]) -> web.Application:
    next_p, next_d = itertools.cycle(prefill), itertools.cycle(decode)
    app = web.Application()

    async def open_session(app: web.Application):
        app["http"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                            connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["http"].close()

    app.cleanup_ctx.append(open_session)

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        http: aiohttp.ClientSession = app["http"]
        first = {**body, "max_tokens": 1, "stream": False,
                 "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
        first.pop("stream_options", None)
        first.pop("max_completion_tokens", None)
        if "min_tokens" in first:
            first["min_tokens"] = min(1, first["min_tokens"])
        async with http.post(next(next_p) + request.path, json=first) as p:
            answer = await p.read()
            if p.status != 200:
                return web.Response(status=p.status, body=answer, content_type="application/json")
        body["kv_transfer_params"] = json.loads(answer).get("kv_transfer_params")
        async with http.post(next(next_d) + request.path, json=body) as d:
            out = web.StreamResponse(status=d.status, headers={
                "Content-Type": d.headers.get("Content-Type", "application/json")})
            await out.prepare(request)
            async for chunk in d.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def models(request: web.Request) -> web.Response:
        async with app["http"].get(decode[0] + "/v1/models") as r:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    app.router.add_post("/v1/completions", relay)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", lambda request: web.Response(text="ok"))
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", action="append", required=True, help="a prefill vLLM's URL")
    p.add_argument("--decode", action="append", required=True, help="a decode vLLM's URL")
    args = p.parse_args()
    web.run_app(make_app(args.prefill, args.decode), host=args.host, port=args.port,
                print=None, access_log=None)


if __name__ == "__main__":
    main()
