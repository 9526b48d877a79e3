"""A vLLM OpenAI server's health, model and load, read over HTTP as the engine API's messages.

Read by the NodeAgent's probes of the vLLM engines it supervises (its heartbeat's
load), by ``pdserve doctor`` (``VllmClient``: versions, a test request through a P/D pair) and by the
Coordinator's ``vllm_engine.VllmEngine`` (static discovery, the dashboard, pair checks). ``VllmServer.health`` is ``GET /health`` (200 while the engine serves;
503 once it died) and ``GET /v1/models`` (the served model, ``max_model_len``);
``VllmServer.stats`` is ``GET /metrics`` (docs/vllm.md lists the series). vLLM does
not serve its role, its KV connector's endpoint or its dtype: the caller passes what
it knows (``VllmIdentity``), and ``compat_hash`` joins what a P/D pair must agree on
(model, block size, KV cache dtype, connector) from what vLLM does report.

Errors: an unreachable server, a timeout or a malformed answer raise
``VllmUnavailable`` (``is_timeout`` tells a slow server from a gone one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from urllib.parse import parse_qs, urlsplit

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from pdserve.api.proto import engine_pb2 as pb

CONFIG_INFO = "vllm:cache_config_info"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"  # prompt tokens a consumer took over its connector


class VllmUnavailable(Exception):
    def __init__(self, message: str, is_timeout: bool = False) -> None:
        super().__init__(message)
        self.is_timeout = is_timeout


@dataclasses.dataclass(frozen=True)
class VllmIdentity:
    """What the supervisor of a vLLM server knows of it and vLLM does not serve."""

    role: str = "hybrid"          # pdserve's role: prefill (kv_producer), decode (kv_consumer), hybrid
    kv_endpoint: str = ""         # the KV connector's side channel, host:port ("" without one)
    kv_connector: str = ""        # e.g. NixlConnector ("" without one)
    kv_events: str = ""           # where its ZMQ publisher of prefix-cache events listens, host:port


def kv_transport_of(connector: str) -> str:
    """The transport name pdserve shows for a vLLM KV connector."""
    return {"NixlConnector": "nixl", "MooncakeConnector": "mooncake"}.get(connector,
                                                                          connector.lower() or "none")


def cache_config(text: str) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` (block_size, cache_dtype, num_gpu_blocks, ...)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == CONFIG_INFO:
                return dict(sample.labels)
    return {}


def counter(text: str, name: str) -> float:
    """The sum of counter ``name``'s samples in vLLM's Prometheus text (0 when absent)."""
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == name)


def compat_hash(model: str, config: dict[str, str], connector: str) -> str:
    """What a vLLM P and D must share to move KV: the model, block size, KV dtype, connector."""
    return (f"vllm:{model}:block={config.get('block_size', '?')}:"
            f"kv_dtype={config.get('cache_dtype', '?')}:{connector or 'none'}")


def stats_from_metrics(text: str, identity: VllmIdentity) -> pb.StatsResponse:
    """vLLM's Prometheus text as the engine API's load report (one engine: samples summed)."""
    values: dict[str, float] = {}
    blocks = block_size = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == CONFIG_INFO:
                blocks = int(sample.labels.get("num_gpu_blocks") or 0)
                block_size = int(sample.labels.get("block_size") or 0)
            else:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    used = round(values.get("vllm:kv_cache_usage_perc", 0.0) * blocks)
    planner = {}  # the planner's counters from vLLM's per-request histograms
    if identity.role != "decode":  # a D's requests "prefill" by loading P's KV
        planner.update(
            num_prefills_total=int(values.get("vllm:request_prefill_time_seconds_count", 0)),
            # per request, so batched prefills overlap: it over-reads busy time
            prefill_busy_s_total=values.get("vllm:request_prefill_time_seconds_sum", 0.0),
            prefill_queue_s_total=values.get("vllm:request_queue_time_seconds_sum", 0.0))
    if identity.role != "prefill":  # a P's requests end after their one token
        # no batch per step: a flat line at the mean inter-token latency
        planner.update(
            num_finished_total=int(values.get("vllm:request_success_total", 0)),
            num_decode_steps_total=int(values.get("vllm:inter_token_latency_seconds_count", 0)),
            decode_step_s_total=values.get("vllm:inter_token_latency_seconds_sum", 0.0))
    return pb.StatsResponse(
        num_running=int(values.get("vllm:num_requests_running", 0)),
        num_waiting=int(values.get("vllm:num_requests_waiting", 0)),
        num_kv_blocks_total=blocks, num_kv_blocks_used=used, num_kv_blocks_free=blocks - used,
        block_size=block_size,
        prefix_cache_query_tokens=int(values.get("vllm:prefix_cache_queries_total", 0)),
        prefix_cache_hit_tokens=int(values.get("vllm:prefix_cache_hits_total", 0)),
        num_preemptions=int(values.get("vllm:num_preemptions_total", 0)),
        num_prompt_tokens_total=int(values.get("vllm:prompt_tokens_total", 0)
                                    - values.get("vllm:prompt_tokens_cached_total", 0)),
        num_generation_tokens_total=int(values.get("vllm:generation_tokens_total", 0)),
        role=identity.role, kv_transport=kv_transport_of(identity.kv_connector),
        kv_endpoint=identity.kv_endpoint, **planner)


class VllmServer:
    """GETs of one vLLM server (``address``: host:port), on a session the caller owns
    (``session()`` is called per request, so an owner may make it lazily)."""

    def __init__(self, address: str, identity: VllmIdentity, session) -> None:
        self.address = address
        self.identity = identity
        self._session = session
        self._fixed: tuple[str, int, str] | None = None  # model, max length, compat hash
        self.block_size = 0  # vLLM's KV block, in tokens: read with the model, 0 before

    async def request(self, method: str, path: str, timeout_s: float, body: dict | None = None,
                      ok_statuses=(200,)) -> tuple[int, bytes]:
        """One HTTP call: (status, body); any other status than ``ok_statuses`` raises
        ``VllmUnavailable`` with the start of vLLM's answer."""
        data = None if body is None else orjson.dumps(body)
        try:
            async with self._session().request(method, f"http://{self.address}{path}", data=data,
                                               headers={"Content-Type": "application/json"} if data else None,
                                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                payload = await response.read()
        except TimeoutError:
            raise VllmUnavailable(f"{method} {path}: no answer in {timeout_s:g} s", is_timeout=True) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise VllmUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from None
        if response.status not in ok_statuses:
            said = f": {payload[:300].decode(errors='replace')}" if method == "POST" else ""
            raise VllmUnavailable(f"{method} {path}: HTTP {response.status}{said}")
        return response.status, payload

    async def get(self, path: str, timeout_s: float, ok_statuses=(200,)) -> tuple[int, bytes]:
        return await self.request("GET", path, timeout_s, ok_statuses=ok_statuses)

    async def health(self, timeout_s: float = 2.0) -> pb.HealthResponse:
        """``GET /health``, and once per server what does not change while it runs (its
        model and max length, its cache config): a probe every second stays one small GET."""
        status, _ = await self.get("/health", timeout_s, ok_statuses=(200, 503))
        if self._fixed is None:
            _, body = await self.get("/v1/models", timeout_s)
            _, metrics = await self.get("/metrics", timeout_s)
            try:
                model = orjson.loads(body)["data"][0]
                name, max_len = str(model["id"]), int(model.get("max_model_len") or 0)
            except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError):
                raise VllmUnavailable(f"GET /v1/models: not a model list: {body[:100]!r}") from None
            config = cache_config(metrics.decode(errors="replace"))
            self.block_size = int(config.get("block_size") or 0)
            self._fixed = (name, max_len, compat_hash(name, config, self.identity.kv_connector))
        name, max_len, compat = self._fixed
        ident = self.identity
        return pb.HealthResponse(
            serving=status == 200, role=ident.role, model=name, device="vllm",
            kv_transport=kv_transport_of(ident.kv_connector), kv_endpoint=ident.kv_endpoint,
            kv_compat_hash=compat, max_model_len=max_len)  # no time_unix_s: vLLM does not tell its clock

    async def stats(self, timeout_s: float = 2.0) -> pb.StatsResponse:
        _, text = await self.get("/metrics", timeout_s)
        try:
            return stats_from_metrics(text.decode(errors="replace"), self.identity)
        except ValueError as exc:  # the parser's word for malformed text
            raise VllmUnavailable(f"GET /metrics: {exc}") from None

    async def post(self, path: str, body: dict, timeout_s: float) -> dict:
        """A POST whose answer is one JSON object."""
        _, payload = await self.request("POST", path, timeout_s, body)
        try:
            answer = orjson.loads(payload)
        except orjson.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            raise VllmUnavailable(f"POST {path}: not a JSON object: {payload[:100]!r}")
        return answer

    async def version(self, timeout_s: float = 2.0) -> str:
        _, body = await self.get("/version", timeout_s)
        try:
            return str(orjson.loads(body)["version"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise VllmUnavailable(f"GET /version: not a version: {body[:100]!r}") from None

    async def probe_side_channel(self, timeout_s: float = 5.0) -> pb.ProbePeerResponse:
        """vLLM serves no KV path probe, and NIXL handshakes on a pair's first transfer,
        D connecting to P's side channel: the probe is that channel accepting a TCP
        connection from here."""
        side_channel = self.identity.kv_endpoint
        if not side_channel:
            return pb.ProbePeerResponse(ok=False, reason=f"{self.address} reports no KV side channel")
        host, _, port = side_channel.rpartition(":")
        started = time.monotonic()
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
        except (OSError, TimeoutError, ValueError) as exc:
            return pb.ProbePeerResponse(ok=False, reason=f"the KV side channel {side_channel} does not "
                                                         f"accept connections: {type(exc).__name__}: {exc}")
        writer.close()
        return pb.ProbePeerResponse(ok=True, handshake_s=time.monotonic() - started,
                                    reason=f"side channel {side_channel} accepts connections "
                                           "(NIXL handshakes on the first transfer)",
                                    transport=self.identity.kv_connector)


    async def test_request(self, decode: VllmServer, timeout_s: float = 10.0) -> pb.ProbePeerResponse:
        """A test request through this prefill vLLM and ``decode``, as the Coordinator's
        legs send one: a prompt of two blocks and a token (fresh random ids, so that no
        prefix cache holds it) to P with ``max_tokens: 1`` and ``do_remote_decode``, then
        to D with P's ``kv_transfer_params``. It passes when D's external prefix-cache
        hits grew by at least a block: D took the prompt from P rather than computing it.
        Every failure is the answer's ``reason``; nothing raises but cancellation."""
        side = await self.probe_side_channel(timeout_s)
        if not side.ok:
            return side
        try:
            health = await self.health(timeout_s)
            block = self.block_size or 16
            length = max(2, min(2 * block + 1, health.max_model_len - 2 if health.max_model_len else 2 * block + 1))
            prompt = [random.randrange(100, 1000) for _ in range(length)]  # any real vocabulary has these
            body = {"model": health.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                    "stream": False}
            _, metrics = await decode.get("/metrics", timeout_s)
            before = counter(metrics.decode(errors="replace"), EXTERNAL_HITS)
            started = time.monotonic()
            answer = await self.post("/v1/completions", {**body, "kv_transfer_params": {
                "do_remote_decode": True, "do_remote_prefill": False}}, timeout_s)
            params = answer.get("kv_transfer_params")
            if not params:
                return pb.ProbePeerResponse(ok=False, reason=f"{self.address} returned no kv_transfer_params: "
                                                             "is it started with a KV connector (kv_producer)?")
            prefilled = time.monotonic()
            await decode.post("/v1/completions", {**body, "kv_transfer_params": params}, timeout_s)
            decoded = time.monotonic()
            _, metrics = await decode.get("/metrics", timeout_s)
            moved = int(counter(metrics.decode(errors="replace"), EXTERNAL_HITS) - before)
        except VllmUnavailable as exc:
            return pb.ProbePeerResponse(ok=False, reason=f"test request: {exc}")
        connector = self.identity.kv_connector or "its connector"
        if moved < min(block, length - 1):
            return pb.ProbePeerResponse(
                ok=False, handshake_s=side.handshake_s,
                reason=f"{decode.address} computed the test prompt itself: {moved} of its {length} tokens "
                       f"came from {self.address} over {connector} (its log says why the transfer failed)")
        return pb.ProbePeerResponse(
            ok=True, handshake_s=side.handshake_s, transfer_s=decoded - prefilled, transport=connector,
            reason=f"a test request moved {moved} prompt tokens P -> D over {connector}: "
                   f"P {(prefilled - started) * 1e3:.0f} ms, D {(decoded - prefilled) * 1e3:.0f} ms")


class VllmClient(VllmServer):
    """A ``VllmServer`` at a ``vllm://`` address with its own HTTP session: the NodeAgent's
    probes and the doctor's checks (``close`` when done)."""

    def __init__(self, address: str) -> None:
        http_address, identity = parse_vllm_address(address)
        self._http: aiohttp.ClientSession | None = None
        super().__init__(http_address, identity, self._own_session)

    def _own_session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None


SCHEME = "vllm://"


def is_vllm_address(address: str) -> bool:
    """An engine address names a vLLM server as
    ``vllm://HOST:PORT[?role=R&kv=HOST:PORT&connector=C&events=HOST:PORT]``
    (the NodeAgent reports its vLLM engines so; a static Coordinator takes it in
    ``--engine``); a bare ``HOST:PORT`` is the embedded engine's gRPC address."""
    return address.startswith(SCHEME)


def parse_vllm_address(address: str) -> tuple[str, VllmIdentity]:
    """``vllm://HOST:PORT?...`` as its HTTP host:port and what the query says of it."""
    parts = urlsplit(address)
    if parts.scheme != "vllm" or not parts.hostname or parts.port is None:
        raise ValueError(f"{address!r}: expected vllm://HOST:PORT")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    role = query.get("role", "hybrid")
    if role not in ("prefill", "decode", "hybrid"):
        raise ValueError(f"{address!r}: role must be prefill, decode or hybrid")
    return parts.netloc, VllmIdentity(role=role, kv_endpoint=query.get("kv", ""),
                                      kv_connector=query.get("connector", ""),
                                      kv_events=query.get("events", ""))
