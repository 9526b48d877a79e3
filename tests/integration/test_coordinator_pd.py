"""The Coordinator in front of real engine processes (tiny model, TCP KV transport).

One set of engines for the module: P1 (prefill), D1 and D2 (decode), H (hybrid, the
greedy reference and the hybrid fallback). Each test builds its own Coordinator app
on them. The last test kills a decode engine, so it runs last.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import threading
import time

import httpx
import openai
import orjson
import pytest

from pdserve.coordinator.app import create_app
from pdserve.coordinator.settings import CoordinatorSettings
from pdserve.runtime.engine_client import EngineClient, build_generate_request
from pdserve.runtime.tokenizer import ByteTokenizer
from tests.procs import PDSERVE, Proc
from tests.stub_engine import StubEngine, start_stub
from tests.unit.coordinator.harness import ALWAYS_PD, AppServer

ENGINE_ARGS = ["--model", "tiny", "--port", "0", "--kv-transport", "tcp", "--num-kv-blocks", "256",
               "--block-size", "8", "--threads", "1"]
TOK = ByteTokenizer(320)


@pytest.fixture(scope="module")
def engines():
    names = {"P1": "prefill", "D1": "decode", "D2": "decode", "H": "hybrid"}
    procs = {n: Proc([*PDSERVE, "engine", *ENGINE_ARGS, "--role", r]) for n, r in names.items()}
    try:
        addrs = {n: p.wait_for(r"serving model .* on (\S+:\d+)", 120).group(1) for n, p in procs.items()}
        yield procs, addrs
    finally:
        for p in procs.values():
            p.stop()


def engine_call(address: str, fn):
    async def go():
        async with EngineClient(address) as client:
            return await fn(client)
    return asyncio.run(go())


def reference(addrs, prompt: str, max_tokens: int) -> list[int]:
    """Greedy output of the hybrid engine alone."""
    async def gen(client):
        req = build_generate_request("", prompt_token_ids=TOK.encode(prompt), max_tokens=max_tokens)
        return [t async for m in client.generate(req, timeout_s=60) for t in m.token_ids]
    return engine_call(addrs["H"], gen)


def assert_all_free(addrs, *names: str) -> None:
    for name in names:
        stats = None
        for _ in range(100):
            stats = engine_call(addrs[name], lambda c: c.stats())
            if stats.num_kv_blocks_free == stats.num_kv_blocks_total and not stats.num_running \
                    and not stats.num_kv_transfers_active:
                break
            time.sleep(0.05)
        assert stats.num_kv_blocks_free == stats.num_kv_blocks_total, f"{name} leaked KV blocks"


def serve(loop, addrs, names, **overrides) -> AppServer:
    settings = CoordinatorSettings(engines=tuple(addrs[n] for n in names), block_size=8,
                                   poll_interval_s=0.2, **{**ALWAYS_PD, **overrides})
    return AppServer(loop, create_app(settings))


def metric(app: AppServer, name: str, **labels) -> float:
    return app.deps.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("mode", ["pull", "push", "layerwise"])
def test_pd_output_equals_hybrid_greedy(engines, loop, mode):
    procs, addrs = engines
    prompt = f"The {mode} mode moves KV from prefill to decode."
    want = reference(addrs, prompt, 24)
    with serve(loop, addrs, ["P1", "D1", "D2"], kv_mode=mode) as app:
        client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0,
            extra_body={"return_token_ids": True}, extra_headers={"x-pdserve-timings": "1"})
        done = raw.parse()
        assert done.choices[0].model_extra["token_ids"] == want
        assert done.choices[0].text == TOK.decode(want)
        assert done.usage.completion_tokens == len(want)
        timings = done.model_extra["pdserve_timings"]
        assert timings["request_id"] == raw.headers["x-request-id"]
        assert timings["kv_transfer_s"] >= 0 and timings["decode_wait_s"] > 0 and timings["ttft_s"] > 0
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                           stream=True, extra_body={"return_token_ids": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == TOK.decode(want)
        assert [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])] == want
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == TOK.decode(reference(
            addrs, f"<|user|>\n{prompt}\n<|assistant|>\n", 8))
        # The legs rode the engines' session ports.
        sessions = httpx.get(app.url + "/ready?verbose=1").json()["sessions"]
        assert addrs["P1"] in sessions and set(sessions.values()) == {"frames"}
    # Request ids reach both engines' logs.
    rid = timings["request_id"]
    assert f"request {rid}" in procs["P1"].output or rid in procs["P1"].output
    assert_all_free(addrs, "P1", "D1", "D2")


def test_stage_timings_add_up_to_the_clients_ttft(engines, loop):
    # The first token goes out with whichever message of it comes first: P's, after
    # route + P's queue and compute (+ the hops), or D's, after route + D's wait for
    # P's KV + D's queue (+ its hop). The TTFT is the earlier of the two.
    _, addrs = engines
    with serve(loop, addrs, ["P1", "D1"], kv_mode="layerwise") as app:
        for n in range(5):
            r = httpx.post(app.url + "/v1/completions", timeout=30,
                           headers={"x-pdserve-timings": "1"},
                           json={"model": "tiny", "prompt": f"timings {n} " * 20, "max_tokens": 4})
            t = r.json()["pdserve_timings"]
            d_side = t["route_s"] + t["decode_wait_s"] + t["decode_queue_s"]
            p_side = t["route_s"] + t["prefill_queue_s"] + t["prefill_compute_s"]
            assert p_side <= t["ttft_s"] < min(p_side, d_side) + 0.05, t
            assert t["prefill_compute_s"] > 0, t
        assert metric(app, "pdserve_coordinator_stage_duration_seconds_count",
                      stage="decode_queue") == 5


def test_short_prompts_prefill_on_decode_by_default(engines, loop, tmp_path):
    _, addrs = engines
    (tmp_path / "admin-key").write_text("admin")  # engine addresses in timings: admin only
    settings = CoordinatorSettings(engines=(addrs["P1"], addrs["D1"]), block_size=8,
                                   poll_interval_s=0.2, admin_key_file=str(tmp_path / "admin-key"))
    admin = {"x-pdserve-timings": "1", "Authorization": "Bearer admin"}
    with AppServer(loop, create_app(settings)) as app:
        short = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0}
        r = httpx.post(app.url + "/v1/completions", json=short, timeout=30, headers=admin)
        t = r.json()["pdserve_timings"]
        assert t["prefill_instance"] == t["decode_instance"] == addrs["D1"]
        assert r.json()["choices"][0]["text"] == TOK.decode(reference(addrs, "hi", 4))
        long = {**short, "prompt": "a longer prompt " * 10}
        t = httpx.post(app.url + "/v1/completions", json=long, timeout=30,
                       headers=admin).json()["pdserve_timings"]
        assert (t["prefill_instance"], t["decode_instance"]) == (addrs["P1"], addrs["D1"])
        assert metric(app, "pdserve_coordinator_prefill_decisions_total",
                      where="decode", reason="short_prompt") == 1
        assert metric(app, "pdserve_coordinator_prefill_decisions_total",
                      where="prefill", reason="long_prompt") == 1
    assert_all_free(addrs, "P1", "D1")


def test_min_tokens_and_ignore_eos_fix_the_output_length(engines, loop):
    _, addrs = engines
    prompt = "prompt 15"  # the tiny preset's greedy output ends with EOS after 9 tokens
    assert len(reference(addrs, prompt, 16)) == 9
    with serve(loop, addrs, ["P1", "D1"]) as app:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}

        def post(**extra):
            return httpx.post(app.url + "/v1/completions", timeout=30, json={**body, **extra})

        assert post().json()["choices"][0]["finish_reason"] == "stop"
        for extra in ({"min_tokens": 16}, {"ignore_eos": True}):
            done = post(**extra).json()
            assert done["usage"]["completion_tokens"] == 16, extra
            assert done["choices"][0]["finish_reason"] == "length"
        assert post(min_tokens=12).json()["usage"]["completion_tokens"] >= 12
        bad = post(min_tokens=17)
        assert bad.status_code == 400 and "min_tokens" in bad.json()["error"]["message"]
    assert_all_free(addrs, "P1", "D1")


def test_hybrid_fallback_runs_whole_requests_on_hybrid(engines, loop):
    _, addrs = engines
    with serve(loop, addrs, ["H", "D1"], fallback_policy="hybrid") as app:
        r = httpx.post(app.url + "/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": "fallback", "max_tokens": 10, "temperature": 0})
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == TOK.decode(reference(addrs, "fallback", 10))
        assert metric(app, "pdserve_coordinator_fallbacks_total", policy="hybrid",
                      reason="no_prefill_engine") == 1


def test_fail_fallback_answers_503(engines, loop):
    _, addrs = engines
    with serve(loop, addrs, ["P1"], fallback_policy="fail") as app:
        r = httpx.post(app.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 503 and "no decode engine" in r.json()["error"]["message"]


def test_queue_fallback_waits_for_a_decode_engine(engines, loop):
    _, addrs = engines
    engine_call(addrs["D1"], lambda c: c.drain())
    try:
        with serve(loop, addrs, ["P1", "D1"], fallback_policy="queue") as app:
            got = {}
            t = threading.Thread(target=lambda: got.setdefault("r", httpx.post(
                app.url + "/v1/completions", timeout=30,
                json={"model": "tiny", "prompt": "queued", "max_tokens": 6, "temperature": 0})))
            t.start()
            time.sleep(0.6)
            assert "r" not in got  # waiting: D1 is draining
            engine_call(addrs["D1"], lambda c: c.drain(resume=True))
            t.join(20)
            assert got["r"].status_code == 200
            assert got["r"].json()["choices"][0]["text"] == TOK.decode(reference(addrs, "queued", 6))
            assert metric(app, "pdserve_coordinator_fallbacks_total", policy="queue",
                          reason="no_decode_engine") == 1
    finally:
        engine_call(addrs["D1"], lambda c: c.drain(resume=True))


@contextlib.contextmanager
def failing_stub_like(loop, addrs, name: str):
    """A stub engine with ``name``'s role and compat hash that fails every leg; yields
    ``addrs`` with it added as "BAD"."""
    health = engine_call(addrs[name], lambda c: c.health())
    server, bad = loop.run(start_stub(StubEngine(role=health.role, behavior="fail",
                                                 kv_compat_hash=health.kv_compat_hash,
                                                 kv_endpoint=health.kv_endpoint)))
    try:
        yield {**addrs, "BAD": bad}
    finally:
        loop.run(server.stop(grace=None))


def test_prefill_failure_before_handoff_retries_on_another_prefill(engines, loop):
    _, addrs = engines
    with failing_stub_like(loop, addrs, "P1") as addrs, \
            serve(loop, addrs, ["BAD", "P1", "D1"], prefill_policy="round_robin", kv_mode="push") as app:
        for k in range(2):  # round robin: one of the two meets the failing P first
            r = httpx.post(app.url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": f"retry {k}", "max_tokens": 8, "temperature": 0})
            assert r.json()["choices"][0]["text"] == TOK.decode(reference(addrs, f"retry {k}", 8))
        assert metric(app, "pdserve_coordinator_retries_total", leg="prefill", stage="before_handoff") == 1
    assert_all_free(addrs, "P1", "D1")


def test_decode_failure_before_first_token_redispatches(engines, loop):
    _, addrs = engines
    with failing_stub_like(loop, addrs, "D1") as addrs, \
            serve(loop, addrs, ["P1", "BAD", "D1"], decode_policy="round_robin", kv_mode="layerwise") as app:
        for k in range(2):
            r = httpx.post(app.url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": f"redispatch {k}", "max_tokens": 8, "temperature": 0})
            assert r.json()["choices"][0]["text"] == TOK.decode(reference(addrs, f"redispatch {k}", 8))
        # D's failure comes before P's first token (before_first_token) or after it went
        # out (mid_stream: a continuation); either way the answer is whole.
        assert sum(metric(app, "pdserve_coordinator_retries_total", leg="decode", stage=stage)
                   for stage in ("before_first_token", "mid_stream")) == 1
    assert_all_free(addrs, "P1", "D1")


def test_auth_and_429_with_real_engines(engines, loop, tmp_path):
    _, addrs = engines
    (tmp_path / "key").write_text("k-123")
    with serve(loop, addrs, ["P1", "D1"], api_key_file=str(tmp_path / "key"),
               max_concurrency=1, max_queue=0) as app:
        denied = openai.OpenAI(base_url=app.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            denied.completions.create(model="tiny", prompt="x", max_tokens=2)
        client = openai.OpenAI(base_url=app.url + "/v1", api_key="k-123", max_retries=0)
        stream = client.completions.create(model="tiny", prompt="long", max_tokens=400,
                                           temperature=0, stream=True)
        next(iter(stream))  # holds the only slot
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert info.value.response.headers["retry-after"]
        rest = list(stream)
        assert rest[-1].choices[0].finish_reason in ("length", "stop")


def test_client_disconnect_frees_kv_on_both_engines(engines, loop):
    _, addrs = engines
    with serve(loop, addrs, ["P1", "D1"], kv_mode="pull") as app:
        body = {"model": "tiny", "prompt": "disconnect " * 20, "max_tokens": 1500, "stream": True}
        with httpx.stream("POST", app.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            seen = [line for _, line in zip(range(6), lines, strict=False)]
            assert any(line.startswith("data: {") for line in seen)
        # Gone: both legs are cancelled and aborted.
        assert_all_free(addrs, "P1", "D1")
        running = engine_call(addrs["D1"], lambda c: c.stats()).num_running
        assert running == 0


def test_client_request_ids_are_labels_never_engine_ids(engines, loop):
    """The same x-request-id twice at once, and the longest one, on real engines: each
    request runs under the Coordinator's own ids (unique, far below the engines' limits)."""
    _, addrs = engines
    with serve(loop, addrs, ["P1", "D1"], kv_mode="push") as app:
        def post(rid: str, max_tokens: int) -> httpx.Response:
            return httpx.post(app.url + "/v1/completions", timeout=60, headers={"x-request-id": rid},
                              json={"model": "tiny", "prompt": "request ids", "temperature": 0,
                                    "max_tokens": max_tokens, "ignore_eos": True})

        longest = post("L" * 128, 8)
        assert longest.status_code == 200, longest.text
        assert longest.headers["x-request-id"] == "L" * 128
        results: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: results.append(post("same", 300)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in results] == [200, 200], [r.text for r in results]
        assert [r.json()["usage"]["completion_tokens"] for r in results] == [300, 300]
        assert results[0].json()["choices"][0]["text"] == results[1].json()["choices"][0]["text"]
        assert metric(app, "pdserve_coordinator_continuations_total") == 0  # nothing aborted
    assert_all_free(addrs, "P1", "D1")


def test_an_over_long_prompt_is_a_400_without_a_traceback(engines, loop, caplog):
    """Both engines refuse the prompt (past their KV capacity): the client's error, one
    log line, no traceback and no task left with an unretrieved error."""
    _, addrs = engines
    caplog.set_level(logging.INFO)
    with serve(loop, addrs, ["P1", "D1"]) as app:
        for _ in range(3):
            r = httpx.post(app.url + "/v1/completions", timeout=30,
                           json={"model": "tiny", "prompt": [65] * 3000, "max_tokens": 2})
            assert r.status_code == 400 and "limit" in r.json()["error"]["message"], r.text
        loop.run(_collect_garbage())
    assert not [f"{r.name}: {r.getMessage()}" for r in caplog.records
                if r.levelno >= logging.ERROR or r.exc_info]
    assert_all_free(addrs, "P1", "D1")


async def _collect_garbage() -> None:
    gc.collect()  # a forgotten task's error is reported when it is collected


def test_decode_killed_mid_stream_continues_with_the_same_tokens(engines, loop):
    procs, addrs = engines
    prompt = "Kill the decode engine halfway through this stream."
    want = reference(addrs, prompt, 1500)
    with serve(loop, addrs, ["P1", "D1", "D2"], kv_mode="layerwise") as app:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1500, "temperature": 0,
                "stream": True, "return_token_ids": True}
        got: list[int] = []
        text: list[str] = []
        killed = None
        with httpx.stream("POST", app.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                assert "error" not in chunk, chunk
                got += chunk["choices"][0].get("token_ids") or []
                text.append(chunk["choices"][0]["text"])
                if killed is None and got:
                    # The decode leg in flight, as the Coordinator sees it (no RPC: be quick).
                    for name in ("D1", "D2"):
                        if app.deps.registry.get(addrs[name]).num_inflight:
                            procs[name].signal(signal.SIGKILL)
                            killed, num_before = name, len(got)
                            break
                    assert killed, "no decode engine was running the request"
        assert got == want
        assert "".join(text) == TOK.decode(want)
        assert metric(app, "pdserve_coordinator_continuations_total") == 1
        assert num_before < len(want)
    survivor = "D2" if killed == "D1" else "D1"
    assert_all_free(addrs, "P1", survivor)
