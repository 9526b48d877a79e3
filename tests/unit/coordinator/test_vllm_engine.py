"""The vLLM backend against a stand-in vLLM: an in-process aiohttp server that answers
with what a real vLLM 0.32 answered (tests/data/vllm/, recorded by
scripts/vllm-capture.py). Each test is one leg's lifecycle: what is sent, the
messages the legs read, how it ends, and nothing left behind (no call, no handoff)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from pdserve.api.proto import engine_pb2 as pb
from pdserve.api.sampling import SamplingParams
from pdserve.coordinator.engine_errors import (
    CallCancelled,
    DeadlinePassed,
    EngineBusy,
    EngineFailed,
    InputRefused,
    Unsupported,
)
from pdserve.coordinator.instances import InstanceRegistry
from pdserve.coordinator.legs import DecodeLeg, PairedLegs, PrefillLeg
from pdserve.coordinator.lifecycle import engine_request, paired_requests
from pdserve.coordinator.metrics import CoordinatorMetrics
from pdserve.coordinator.sessions import EmbeddedEngine
from pdserve.coordinator.timings import RequestTimings
from pdserve.coordinator.vllm_engine import Handoffs, VllmBackend, VllmEngine
from pdserve.coordinator.vllm_wire import completion_body
from pdserve.runtime.vllm_server import VllmIdentity, parse_vllm_address, stats_from_metrics
from tests.unit.coordinator.harness import inst

DATA = Path(__file__).parents[2] / "data" / "vllm"
# What vLLM answers when its admission limit (--max-num-queued-reqs) refuses a request:
# vllm.exceptions.QueueOverflowError through create_error_response.
BUSY = (503, b'{"error":{"message":"The engine is currently busy and cannot accept new requests. '
             b'Please try again later or on a different instance.","type":"Service Unavailable",'
             b'"param":null,"code":503}}')


def recorded(name: str) -> tuple[int, bytes]:
    return int((DATA / f"{name}.status").read_text()), (DATA / f"{name}.response").read_bytes()


def sent(name: str) -> dict:
    return json.loads((DATA / f"{name}.request.json").read_text())


def events(name: str) -> list[dict]:
    """The data of a recorded SSE stream, [DONE] left out."""
    lines = recorded(name)[1].decode().split("\n")
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def stream_tokens(name: str) -> list[int]:
    return [t for e in events(name) for c in e["choices"] for t in c.get("token_ids") or ()]


class FakeVllm:
    """Answers ``/v1/completions`` by the request's shape with the recorded answer of
    that shape (or ``answer``, when a test sets one); GET routes as recorded."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.request_ids: list[str] = []
        self.answer: tuple[int, bytes] | None = None
        self.holds = False  # a stream stops after its first event and stays open
        self.disconnected = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        for path, name in (("/health", "health"), ("/v1/models", "models")):
            app.router.add_get(path, self._replay(name))
        self.external_hits = 5  # the recorded counter's value
        self.takes_kv = True  # a request with P's kv_transfer_params counts its prompt, but a token, as external hits
        app.router.add_get("/metrics", self._metrics)
        self.version = "0.32.0"
        app.router.add_get("/version", self._version)
        self.runner = web.AppRunner(app)

    async def start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        await self.runner.cleanup()

    @staticmethod
    def shape(body: dict) -> str:
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            return "prefill"
        if kv.get("do_remote_prefill"):
            return "decode_stream" if body["stream"] else "single_whole"
        if max(body["prompt"]) >= 49152:
            return "bad_request"
        return "single_stream" if body["stream"] else "single_whole"

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if (body.get("kv_transfer_params") or {}).get("do_remote_prefill") and self.takes_kv:
            self.external_hits += len(body["prompt"]) - 1
        self.request_ids.append(request.headers.get("X-Request-Id", ""))
        status, payload = self.answer or recorded(self.shape(body))
        if not payload.startswith(b"data: "):
            return web.Response(status=status, body=payload, content_type="application/json")
        response = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in payload.split(b"\n\n")[:-1]:
            await response.write(event + b"\n\n")
            while self.holds:  # until the client goes: a write to it fails
                try:
                    await response.write(b": keep-alive\n\n")
                    await asyncio.sleep(0.02)
                except ConnectionError:
                    self.disconnected.set()
                    return response
        return response

    async def _metrics(self, _: web.Request) -> web.Response:
        status, payload = recorded("metrics")
        line = b'vllm:external_prefix_cache_hits_total{engine="0",model_name="smollm2"} '
        return web.Response(status=status, body=payload.replace(
            line + b"5.0", line + str(float(self.external_hits)).encode()))

    async def _version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": self.version})

    def _replay(self, name: str):
        async def handler(request: web.Request) -> web.Response:
            status, payload = recorded(name)
            return web.Response(status=status, body=payload)
        return handler


class Backend(VllmBackend):
    """Keeps the engines it made, for the leak check."""

    def __init__(self) -> None:
        super().__init__()
        self.made = []

    def connect(self, address: str):
        self.made.append(super().connect(address))
        return self.made[-1]


def run(scenario) -> None:
    """``scenario(fake, backend, address)`` on a fresh loop, a stand-in vLLM and a
    backend; at the end nothing is left: no call, no handoff."""
    async def main():
        fake = FakeVllm()
        address = f"vllm://{await fake.start()}?role=decode"
        backend = Backend()
        try:
            await scenario(fake, backend, address)
            assert [e.num_calls for e in backend.made] == [0] * len(backend.made)
            assert len(backend.handoffs) == 0
        finally:
            for engine in backend.made:
                await engine.close()
            await fake.stop()

    asyncio.run(main())

    asyncio.run(main())


def request(prompt: list[int], role: str = "", transfer_id: str = "t1", **sampling) -> pb.GenerateRequest:
    params = SamplingParams(**{"max_tokens": 8, **sampling})
    kv = pb.KVTransferParams(role=role, transfer_id=transfer_id) if role else None
    return engine_request(params, "r1", prompt, 0, kv)


async def read_all(call) -> list[pb.GenerateResponse]:
    return [message async for message in call]


def test_single_leg_streams_vllms_token_ids_with_timings_first_and_the_finish_last():
    async def scenario(fake, backend, address):
        engine = backend.connect(address)
        body = sent("single_stream")
        messages = await read_all(engine.generate(
            request(body["prompt"], logprobs=True, top_logprobs=2), timeout_s=10))
        assert [t for m in messages for t in m.token_ids] == stream_tokens("single_stream")
        assert messages[0].HasField("timings") and messages[0].timings.prefill_s > 0
        assert messages[0].num_prompt_tokens == len(body["prompt"])
        assert [m.finished for m in messages] == [False] * (len(messages) - 1) + [True]
        assert messages[-1].finish_reason == events("single_stream")[-1]["choices"][0]["finish_reason"]
        assert messages[-1].num_output_tokens == len(stream_tokens("single_stream"))
        logprobs = [e for m in messages for e in m.logprobs]
        assert [e.token_id for e in logprobs] == stream_tokens("single_stream")
        assert all(len(e.top) == 2 and e.top[0].logprob >= e.top[1].logprob for e in logprobs)
        assert fake.request_ids == ["r1"]
        assert fake.bodies[0]["return_token_ids"] and fake.bodies[0]["stream"]
        assert fake.bodies[0]["return_tokens_as_token_ids"] and fake.bodies[0]["logprobs"] == 2

    run(scenario)


def test_prompt_logprobs_read_whole_as_one_finished_message():
    async def scenario(fake, backend, address):
        engine = backend.connect(address)
        prompt = sent("single_whole")["prompt"]
        messages = await read_all(engine.generate(
            request(prompt, logprobs=True, top_logprobs=1, prompt_logprobs=True), timeout_s=10))
        answer = orjson.loads(recorded("single_whole")[1])
        assert len(messages) == 1 and messages[0].finished
        assert list(messages[0].token_ids) == answer["choices"][0]["token_ids"]
        assert [e.token_id for e in messages[0].prompt_logprobs] == prompt[1:]
        assert not fake.bodies[0]["stream"] and fake.bodies[0]["prompt_logprobs"] == 1

    run(scenario)


def test_pd_pair_prefill_hands_its_kv_params_to_the_decode_leg_of_its_transfer():
    async def scenario(fake, backend, address):
        engine = backend.connect(address)
        prompt = sent("prefill")["prompt"]
        decode = engine.generate(request(prompt, "decode"), timeout_s=10)
        await asyncio.sleep(0.05)
        assert fake.bodies == []  # D waits for P's params before asking vLLM anything
        prefill_messages = await read_all(engine.generate(request(prompt, "prefill"), timeout_s=10))
        decode_messages = await read_all(decode)
        p_answer = orjson.loads(recorded("prefill")[1])
        first, handoff = prefill_messages
        assert list(first.token_ids) == p_answer["choices"][0]["token_ids"]
        assert first.HasField("timings") and first.timings.prefill_s > 0
        assert handoff.finished and handoff.finish_reason == "handoff"
        p_body, d_body = fake.bodies
        assert p_body["max_tokens"] == 1 and not p_body["stream"]
        assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
        assert d_body["kv_transfer_params"] == p_answer["kv_transfer_params"]
        assert d_body["max_tokens"] == 8 and d_body["stream"]
        tokens = [t for m in decode_messages for t in m.token_ids]
        assert tokens == stream_tokens("decode_stream")
        assert tokens[0] == first.token_ids[0]  # D's first token is P's again
        assert decode_messages[0].timings.kv_wait_s > 0 and decode_messages[-1].finished

    run(scenario)


def test_paired_legs_read_a_vllm_pair_as_they_read_the_embedded_engine():
    async def scenario(fake, backend, address):
        engine = backend.connect(address)
        prompt = sent("prefill")["prompt"]
        timings = RequestTimings("r1", CoordinatorMetrics())
        d_req, p_req = paired_requests(
            SamplingParams(max_tokens=8, logprobs=True, top_logprobs=2), "r1", prompt, 0,
            pb.KVTransferParams(role="decode", transfer_id="t1"),
            pb.KVTransferParams(role="prefill", transfer_id="t1"))
        aborts = []
        aborter = type("A", (), {"abort_soon": lambda self, e, rid: aborts.append(rid)})()
        pair = PairedLegs(PrefillLeg(inst("p1", "prefill"), p_req, engine, timings, aborter),
                          DecodeLeg(inst("d1", "decode"), d_req, engine, timings, aborter))
        pair.start(10.0)
        tokens, scored = [], []
        async for ids in pair.tokens():
            tokens += ids
            scored += [e.token_id for e in pair.take_logprobs()]
        await pair.wait_report()
        pair.close()
        assert tokens == stream_tokens("decode_stream")
        assert scored == tokens  # one logprob per token: the first P's, the rest D's
        assert pair.finish_reason in ("stop", "length") and not aborts
        assert timings.report["prefill_compute_s"] > 0

    run(scenario)


@pytest.mark.parametrize("answer, role, error, details", [
    ("bad_request", "", InputRefused, ""),
    ("too_long", "", InputRefused, ""),
    (BUSY, "prefill", EngineBusy, "prefill full"),
    (BUSY, "", EngineBusy, "decode full"),
    ((500, b'{"error":{"message":"Internal server error","type":"InternalServerError",'
           b'"param":null,"code":500}}'), "", EngineFailed, "HTTP 500"),
    ((200, b'data: {"error": {"message": "Internal server error", "type": '
           b'"InternalServerError", "param": null, "code": 500}}\n\ndata: [DONE]\n\n'),
     "", EngineFailed, "HTTP 500"),
])
def test_vllm_errors_become_pdserves(answer, role, error, details):
    async def scenario(fake, backend, address):
        engine = backend.connect(address)
        fake.answer = recorded(answer) if isinstance(answer, str) else answer
        with pytest.raises(error) as info:
            await read_all(engine.generate(request([1, 2, 3], role), timeout_s=10))
        assert info.value.details.startswith(details)

    run(scenario)


def test_an_engine_that_is_not_there_failed_not_busy():
    async def scenario(fake, backend, address):
        engine = backend.connect("vllm://127.0.0.1:9")  # discard port: connection refused
        with pytest.raises(EngineFailed):
            await read_all(engine.generate(request([1, 2, 3]), timeout_s=10))
        with pytest.raises(EngineFailed):
            await engine.health()

    run(scenario)


def test_decode_leg_without_its_prefill_passes_its_deadline_and_forgets_the_handoff():
    async def scenario(fake, backend, address):
        engine = backend.connect(address)
        started = time.monotonic()
        with pytest.raises(DeadlinePassed):
            await read_all(engine.generate(request([1, 2, 3], "decode"), timeout_s=0.2))
        assert 0.2 <= time.monotonic() - started < 2 and fake.bodies == []

    run(scenario)


def test_idle_bound_ends_a_stream_that_stopped_and_closes_its_connection():
    async def scenario(fake, backend, address):
        engine = backend.connect(address)
        fake.holds = True
        call = engine.generate(request(sent("single_stream")["prompt"]), timeout_s=10, idle_s=0.3)
        first = await call.__anext__()
        assert first.token_ids
        with pytest.raises(DeadlinePassed):
            await call.__anext__()
        await asyncio.wait_for(fake.disconnected.wait(), 5)  # vLLM would abort the request

    run(scenario)


def test_cancel_and_abort_close_the_request_on_vllm():
    async def scenario(fake, backend, address):
        engine = backend.connect(address)
        fake.holds = True
        call = engine.generate(request(sent("single_stream")["prompt"]), timeout_s=10)
        await call.__anext__()
        assert call.cancel() and not call.cancel()
        with pytest.raises(CallCancelled):
            await call.__anext__()
        await asyncio.wait_for(fake.disconnected.wait(), 5)
        fake.disconnected.clear()
        second = engine.generate(request(sent("single_stream")["prompt"]), timeout_s=10)
        await second.__anext__()
        assert await engine.abort("r1") and not await engine.abort("r1")
        await asyncio.wait_for(fake.disconnected.wait(), 5)

    run(scenario)


def test_health_and_stats_from_vllms_routes():
    async def scenario(fake, backend, address):
        engine = backend.connect(address)
        health = await engine.health()
        models = orjson.loads(recorded("models")[1])["data"][0]
        assert health.serving and health.role == "decode" and health.model == models["id"]
        assert health.max_model_len == models["max_model_len"]
        assert health.kv_compat_hash == f"vllm:{models['id']}:block=128:kv_dtype=auto:none"
        stats = await engine.stats()
        assert stats.num_kv_blocks_total > 0 and stats.block_size > 0
        assert stats.num_kv_blocks_used + stats.num_kv_blocks_free == stats.num_kv_blocks_total
        assert stats.num_prompt_tokens_total > 0 and stats.num_generation_tokens_total > 0
        with pytest.raises(Unsupported):
            async for _ in engine.kv_events():
                pass

    run(scenario)


def test_stats_read_load_and_kv_usage_from_vllms_gauges():
    text = "\n".join([
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        "# TYPE vllm:cache_config_info gauge",
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="400"} 1.0', ""])
    stats = stats_from_metrics(text, VllmIdentity(role="prefill", kv_endpoint="h:5", kv_connector="NixlConnector"))
    assert (stats.num_running, stats.num_waiting) == (3, 2)
    assert (stats.num_kv_blocks_total, stats.num_kv_blocks_used, stats.num_kv_blocks_free) == (400, 100, 300)
    assert stats.block_size == 16 and stats.role == "prefill"
    assert (stats.kv_transport, stats.kv_endpoint) == ("nixl", "h:5")


def test_completion_body_carries_every_sampling_setting_vllm_has():
    params = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, seed=7,
                            stop=["\n"], stop_token_ids=[2], min_tokens=1, min_p=0.05,
                            presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1,
                            logit_bias={13: -5.0}, logprobs=True, top_logprobs=3,
                            guided=("json_schema", '{"type": "object"}'))
    body = completion_body(engine_request(params, "r1", [1, 2], 0))
    assert body == {
        "prompt": [1, 2], "stream": True, "return_token_ids": True, "max_tokens": 5,
        "min_tokens": 1, "temperature": pytest.approx(0.7), "top_p": pytest.approx(0.9),
        "ignore_eos": False, "presence_penalty": 0.5, "frequency_penalty": 0.25,
        "repetition_penalty": pytest.approx(1.1), "top_k": 40, "min_p": pytest.approx(0.05),
        "stop": ["\n"], "stop_token_ids": [2], "seed": 7, "logit_bias": {"13": -5.0},
        "logprobs": 3, "return_tokens_as_token_ids": True,
        "structured_outputs": {"json": {"type": "object"}}}
    greedy = completion_body(engine_request(SamplingParams(max_tokens=3), "r1", [1], 0))
    assert "seed" not in greedy and "logprobs" not in greedy and greedy["temperature"] == 0


def test_a_handoff_put_before_its_decode_leg_waits_for_it_then_is_dropped_unclaimed(monkeypatch):
    monkeypatch.setattr("pdserve.coordinator.vllm_engine.HANDOFF_KEEP_S", 0.05)

    async def scenario():
        handoffs = Handoffs()
        handoffs.put("t1", {"remote_engine_id": "p"})
        assert await handoffs.wait("t1") == {"remote_engine_id": "p"}
        handoffs.drop("t1")
        handoffs.put("t2", {"remote_engine_id": "p"})  # no decode leg ever comes
        assert len(handoffs) == 1
        await asyncio.sleep(0.1)
        assert len(handoffs) == 0

    asyncio.run(scenario())


def test_a_vllm_address_says_the_role_side_channel_and_connector_vllm_does_not_serve():
    backend = VllmBackend()
    p = backend.connect("vllm://10.0.0.1:8000?role=prefill&kv=10.0.0.1:5600&connector=NixlConnector")
    assert p.role == "prefill" and p.url == "http://10.0.0.1:8000"
    assert p.server.identity == VllmIdentity("prefill", "10.0.0.1:5600", "NixlConnector")
    assert backend.connect("vllm://h:1").role == "hybrid"
    assert p.handoffs is backend.connect("vllm://h:1").handoffs
    for bad in ("h:1", "vllm://h", "vllm://h:1?role=boss"):
        with pytest.raises(ValueError):
            parse_vllm_address(bad)


def test_the_registry_connects_a_vllm_address_to_vllm_and_a_bare_one_to_the_embedded_engine():
    async def scenario():
        registry = InstanceRegistry()
        assert isinstance(registry.engine("vllm://h:1?role=decode"), VllmEngine)
        assert isinstance(registry.engine("h:1"), EmbeddedEngine)
        assert registry.engine("vllm://h:1?role=decode") is registry.engine("vllm://h:1?role=decode")

    asyncio.run(scenario())


def test_the_probe_of_a_vllm_pair_is_ps_side_channel_accepting_a_connection():
    async def scenario():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        backend = VllmBackend()
        ok = await backend.connect(f"vllm://h:1?role=prefill&kv=127.0.0.1:{port}").probe_peer("d:2")
        assert ok.ok and ok.handshake_s > 0, ok
        server.close()
        await server.wait_closed()
        gone = await backend.connect(f"vllm://h:2?role=prefill&kv=127.0.0.1:{port}").probe_peer("d:2")
        assert not gone.ok and "does not accept connections" in gone.reason
        none = await backend.connect("vllm://h:3?role=prefill").probe_peer("d:2")
        assert not none.ok and "no KV side channel" in none.reason

    asyncio.run(scenario())


def test_a_static_coordinator_refuses_a_malformed_vllm_address():
    from pdserve.coordinator.settings import CoordinatorSettings

    assert CoordinatorSettings(engines=("vllm://h:1?role=prefill", "h:2")).engines[0].startswith("vllm")
    with pytest.raises(ValueError, match="expected vllm://HOST:PORT"):
        CoordinatorSettings(engines=("vllm://h",))


def test_vllms_block_events_become_pdserves_chains_at_the_coordinators_block_size():
    from pdserve.coordinator.vllm_wire import BlockMap
    from pdserve.runtime.block_hash import hash_chain

    tokens = list(range(100, 164))  # two vLLM blocks of 32 = eight of ours of 8
    blocks = BlockMap(8)
    stored, removed, cleared = blocks.apply([
        {"type": "BlockStored", "block_hashes": [b"a"], "parent_block_hash": None,
         "token_ids": tokens[:32], "block_size": 32},
        {"type": "BlockStored", "block_hashes": [b"b"], "parent_block_hash": b"a",
         "token_ids": tokens[32:], "block_size": 32}])
    assert stored == hash_chain(tokens, 8) and removed == [] and not cleared
    # the router's chain of a prompt with this prefix matches all eight
    assert hash_chain(tokens + [1, 2, 3], 8)[:8] == stored
    # a block whose parent was never seen is skipped, and so are its children
    assert blocks.apply([{"type": "BlockStored", "block_hashes": [b"x", b"y"], "parent_block_hash": b"?",
                          "token_ids": tokens, "block_size": 32}])[0] == []
    stored, removed, _ = blocks.apply([{"type": "BlockRemoved", "block_hashes": [b"b", b"never"]}])
    assert stored == [] and removed == hash_chain(tokens, 8)[4:]
    assert blocks.apply([{"type": "AllBlocksCleared"}]) == ([], [], True) and len(blocks) == 0
    with pytest.raises(ValueError, match="not made of"):
        BlockMap(24).apply([{"type": "BlockStored", "block_hashes": [b"a"], "parent_block_hash": None,
                             "token_ids": tokens[:32], "block_size": 32}])


def test_kv_events_from_a_vllm_publisher_reach_the_prefix_index_as_its_hashes():
    """A ZMQ publisher speaking vLLM's frames (topic, seq, msgpack [ts, events]) and the
    Coordinator's feed: the index holds the chain of the stored blocks."""
    import msgpack
    import zmq
    import zmq.asyncio

    from pdserve.coordinator.kv_events import KVEventFeeds
    from pdserve.coordinator.metrics import CoordinatorMetrics
    from pdserve.coordinator.prefix_index import PrefixIndex
    from pdserve.runtime.block_hash import hash_chain
    from tests.unit.coordinator.harness import inst

    tokens = list(range(7, 7 + 64))

    async def scenario():
        pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        registry = InstanceRegistry()
        address = f"vllm://127.0.0.1:1?role=decode&events=127.0.0.1:{port}"
        d1 = inst("d1", "decode")
        d1.address = address
        registry.replace([d1])
        index = PrefixIndex(1000)
        feeds = KVEventFeeds(registry, index, CoordinatorMetrics(), 16)
        await feeds.start()
        try:
            for seq in range(200):  # until the feed has subscribed (ZMQ drops what it sends before)
                batch = [time.time(), [{"type": "BlockStored", "block_hashes": [b"h1"],
                                        "parent_block_hash": None, "token_ids": tokens,
                                        "block_size": 64}]]
                await pub.send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb(batch)])
                await asyncio.sleep(0.02)
                if index.match("d1", hash_chain(tokens, 16)) == 4:
                    break
            assert index.match("d1", hash_chain(tokens + [1], 16)) == 4
        finally:
            await feeds.stop()
            await registry.close()
            pub.close(0)

    asyncio.run(scenario())


def test_the_doctor_checks_vllm_engines_their_versions_and_a_test_request_through_each_pair():
    from pdserve.api.proto import controller_pb2 as cpb
    from pdserve.runtime.doctor_checks import FAIL, PASS, check_engines
    from pdserve.runtime.security import SecuritySettings

    async def scenario():
        p, d = FakeVllm(), FakeVllm()
        side = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        side_port = side.sockets[0].getsockname()[1]
        p_address = f"vllm://{await p.start()}?role=prefill&kv=127.0.0.1:{side_port}&connector=NixlConnector"
        d_address = f"vllm://{await d.start()}?role=decode&kv=127.0.0.1:1&connector=NixlConnector"
        views = [cpb.InstanceView(instance_id="p0", role="prefill", engine_address=p_address,
                                  kv_endpoint=f"127.0.0.1:{side_port}", kv_compat_hash="h"),
                 cpb.InstanceView(instance_id="d0", role="decode", engine_address=d_address,
                                  kv_endpoint="127.0.0.1:1", kv_compat_hash="h")]
        try:
            rows = {c.name: c for c in await check_engines(views, SecuritySettings())}
            assert rows["engine p0"].status == PASS and "serving model 'smollm2'" in rows["engine p0"].detail
            assert rows["engine d0 kv budget"].status == PASS and "engine d0 clock" not in rows
            assert rows["vllm versions"].status == PASS and "0.32.0" in rows["vllm versions"].detail
            assert rows["kv p0 -> d0"].status == PASS, rows["kv p0 -> d0"]
            assert "moved 256 prompt tokens P -> D over NixlConnector" in rows["kv p0 -> d0"].detail
            # The pair's test request: a fresh 2-block prompt (128-token blocks), P asked
            # for its KV params, D given them; both for one token.
            (to_p,), (to_d,) = p.bodies[-1:], d.bodies[-1:]
            assert to_p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
            assert to_d["kv_transfer_params"]["do_remote_prefill"] and to_p["prompt"] == to_d["prompt"]
            assert len(to_p["prompt"]) == 257 and to_p["max_tokens"] == to_d["max_tokens"] == 1
            d.takes_kv = False  # D computes the prompt itself: the transfer did not happen
            rows = {c.name: c for c in await check_engines(views, SecuritySettings())}
            assert rows["kv p0 -> d0"].status == FAIL and "computed the test prompt itself: 0 of its 257" \
                in rows["kv p0 -> d0"].detail
            d.takes_kv = True
            p.answer = (500, b'{"error": {"message": "boom"}}')
            rows = {c.name: c for c in await check_engines(views, SecuritySettings())}
            assert rows["kv p0 -> d0"].status == FAIL and "HTTP 500" in rows["kv p0 -> d0"].detail
            p.answer = None
            d.version = "0.31.0"
            side.close()
            await side.wait_closed()
            rows = {c.name: c for c in await check_engines(views, SecuritySettings())}
            assert rows["vllm versions"].status == FAIL and "versions differ" in rows["vllm versions"].detail
            assert rows["kv p0 -> d0"].status == FAIL and "does not accept" in rows["kv p0 -> d0"].detail
        finally:
            await p.stop()
            await d.stop()

    asyncio.run(scenario())


def test_stats_give_the_planner_prefill_counters_on_p_and_decode_counters_on_d():
    text = "\n".join([
        "# TYPE vllm:prompt_tokens counter", 'vllm:prompt_tokens_total{engine="0"} 1000.0',
        "# TYPE vllm:prompt_tokens_cached counter", 'vllm:prompt_tokens_cached_total{engine="0"} 300.0',
        "# TYPE vllm:request_prefill_time_seconds histogram",
        'vllm:request_prefill_time_seconds_count{engine="0"} 4.0',
        'vllm:request_prefill_time_seconds_sum{engine="0"} 0.8',
        "# TYPE vllm:request_queue_time_seconds histogram",
        'vllm:request_queue_time_seconds_count{engine="0"} 4.0',
        'vllm:request_queue_time_seconds_sum{engine="0"} 0.2',
        "# TYPE vllm:request_success counter",
        'vllm:request_success_total{engine="0",finished_reason="length"} 3.0',
        'vllm:request_success_total{engine="0",finished_reason="stop"} 1.0',
        "# TYPE vllm:inter_token_latency_seconds histogram",
        'vllm:inter_token_latency_seconds_count{engine="0"} 50.0',
        'vllm:inter_token_latency_seconds_sum{engine="0"} 2.5', ""])
    p = stats_from_metrics(text, VllmIdentity(role="prefill", kv_endpoint="h:5", kv_connector="NixlConnector"))
    assert p.num_prompt_tokens_total == 700  # computed: the cached ones excluded
    assert (p.num_prefills_total, p.prefill_busy_s_total, p.prefill_queue_s_total) == (4, 0.8, 0.2)
    assert (p.num_finished_total, p.num_decode_steps_total) == (0, 0)  # P's one-token requests
    d = stats_from_metrics(text, VllmIdentity(role="decode", kv_endpoint="h:6", kv_connector="NixlConnector"))
    assert (d.num_prefills_total, d.prefill_busy_s_total) == (0, 0.0)  # D loads P's KV
    assert (d.num_finished_total, d.num_decode_steps_total, d.decode_step_s_total) == (4, 50, 2.5)
