"""The engine as a real process, spoken to over gRPC and through the CLI."""

from __future__ import annotations

import asyncio
import json
import subprocess

import grpc
import pytest

from pdserve.api.engine_client import EngineClient, build_generate_request
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from tests.procs import PDSERVE, REPO, start_engine

PROMPTS = [[1, 2, 3], [50, 60, 70, 80, 90] * 7, list(range(100, 140))]


@pytest.fixture(scope="module")
def engine_server():
    proc, address = start_engine("--num-kv-blocks", "128", "--block-size", "8")
    yield address
    assert proc.stop() in (0, -15)


@pytest.fixture(scope="module")
def reference_outputs():
    engine = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=128, block_size=8))
    return engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))


async def collect(client, request):
    msgs = [m async for m in client.generate(request, timeout_s=60)]
    return [t for m in msgs for t in m.token_ids], msgs


def test_concurrent_streams_match_in_process_engine(engine_server, reference_outputs):
    async def go():
        async with EngineClient(engine_server) as client:
            reqs = [build_generate_request(f"r{i}", "", p, max_tokens=12, ignore_eos=True)
                    for i, p in enumerate(PROMPTS)]
            results = await asyncio.gather(*(collect(client, r) for r in reqs))
            stats = await client.stats()
            return results, stats

    results, stats = asyncio.run(go())
    for (tokens, msgs), ref in zip(results, reference_outputs, strict=True):
        assert tokens == ref
        assert len(msgs) == 12  # streamed token by token
        assert msgs[-1].finished and msgs[-1].finish_reason == "length"
        assert not any(m.finished for m in msgs[:-1])
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total == 128
    assert stats.num_running == stats.num_waiting == 0


def test_bad_input_is_refused_and_server_keeps_serving(engine_server, reference_outputs):
    bad = [
        build_generate_request("b1", "", []),  # empty prompt
        build_generate_request("b2", "", [1, 2, 99999]),  # out of vocabulary
        build_generate_request("b3", "", [1, 2], max_tokens=4, top_p=1.5),
        build_generate_request("b4", "", [1] * 5000),  # longer than the model
    ]

    async def go():
        async with EngineClient(engine_server) as client:
            errors = []
            for req in bad:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await collect(client, req)
                errors.append((info.value.code(), info.value.details()))
            good = await collect(client, build_generate_request("g", "", PROMPTS[0], max_tokens=12, ignore_eos=True))
            return errors, good[0], await client.health()

    errors, good, health = asyncio.run(go())
    assert all(code == grpc.StatusCode.INVALID_ARGUMENT for code, _ in errors)
    assert "empty" in errors[0][1]
    assert "vocabulary" in errors[1][1] or "[0, 320)" in errors[1][1]
    assert "top_p" in errors[2][1]
    assert "limit" in errors[3][1]
    assert good == reference_outputs[0]
    assert health.serving and health.role == "hybrid" and health.model == "tiny"


def test_client_disconnect_frees_blocks(engine_server):
    async def go():
        async with EngineClient(engine_server) as client:
            call = client.generate(build_generate_request("long", "", PROMPTS[2], max_tokens=2000, ignore_eos=True))
            got = 0
            async for _ in call:
                got += 1
                if got == 3:
                    break
            call.cancel()
            for _ in range(50):
                stats = await client.stats()
                if stats.num_running == 0 and stats.num_kv_blocks_free == stats.num_kv_blocks_total:
                    return stats, await client.abort("long")
                await asyncio.sleep(0.1)
            return stats, None

    stats, aborted_again = asyncio.run(go())
    assert stats.num_running == 0
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
    assert aborted_again is False  # abort is idempotent: already gone


def test_cli_generate_json_local_and_remote(engine_server, reference_outputs):
    local = subprocess.run(
        [*PDSERVE, "generate", "--model", "tiny", "--prompt-token-ids", "1,2,3",
         "--max-tokens", "12", "--ignore-eos", "--temperature", "0", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=True,
    )
    remote = subprocess.run(
        [*PDSERVE, "generate", "--server", engine_server, "--prompt-token-ids", "1,2,3",
         "--max-tokens", "12", "--ignore-eos", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=True,
    )
    for out in (local, remote):
        result = json.loads(out.stdout)
        assert result["token_ids"] == reference_outputs[0]
        assert isinstance(result["text"], str)


def test_cli_errors_exit_with_code_2(engine_server):
    cases = [
        ["--model", "no-such-preset", "--prompt", "x"],
        ["--model", "tiny", "--prompt-token-ids", "1,x"],
        ["--server", engine_server, "--prompt-token-ids", "1,2", "--temperature", "-1"],
    ]
    for args in cases:
        out = subprocess.run([*PDSERVE, "generate", *args], capture_output=True, text=True,
                             cwd=REPO, timeout=120)
        assert out.returncode == 2, out
        assert out.stderr.startswith("error:")


def test_cluster_token_is_required_when_configured():
    import os

    from pdserve.api.security import SecuritySettings
    from tests.procs import Proc

    proc = Proc([*PDSERVE, "engine", "--model", "tiny", "--port", "0", "--num-kv-blocks", "32"],
                env={"PDSERVE_CLUSTER_TOKEN": "s3cret"})
    try:
        address = proc.wait_for(r"serving model .* on (\S+:\d+)", timeout_s=120).group(1)

        async def go(token):
            async with EngineClient(address, SecuritySettings(token=token)) as client:
                try:
                    health = await client.health()
                    msgs = [m async for m in client.generate(
                        build_generate_request("t", "", [1, 2], max_tokens=2), timeout_s=30)]
                    return health.serving and len(msgs) == 2, None
                except grpc.aio.AioRpcError as exc:
                    return False, exc.code()

        assert asyncio.run(go("s3cret")) == (True, None)
        assert asyncio.run(go("wrong")) == (False, grpc.StatusCode.UNAUTHENTICATED)
        assert asyncio.run(go(None)) == (False, grpc.StatusCode.UNAUTHENTICATED)
        proc.wait_for("refused .*wrong cluster token", timeout_s=10)
        assert os.environ.get("PDSERVE_CLUSTER_TOKEN") is None
    finally:
        proc.stop()
