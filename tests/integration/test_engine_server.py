"""The engine as a real process: over gRPC, through the CLI, its KV port by raw sockets, signals."""

from __future__ import annotations

import asyncio
import glob
import json
import signal
import socket
import subprocess
import time

import grpc
import pytest

from pdserve.api.sampling import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_transfer.transport import wire
from pdserve.engine.llm_engine import LLMEngine
from pdserve.runtime.engine_client import EngineClient, build_generate_request
from tests.procs import PDSERVE, REPO, start_engine

PROMPTS = [[1, 2, 3], [50, 60, 70, 80, 90] * 7, list(range(100, 140))]


@pytest.fixture(scope="module")
def engine_process():
    proc, address = start_engine("--num-kv-blocks", "128", "--block-size", "8")
    yield proc, address
    assert proc.stop() in (0, -15)


@pytest.fixture(scope="module")
def engine_server(engine_process):
    return engine_process[1]


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

    from pdserve.runtime.security import SecuritySettings
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


def test_abort_rpc_ends_the_open_stream_and_frees_its_blocks(engine_server):
    async def go():
        async with EngineClient(engine_server) as client:
            call = client.generate(build_generate_request(
                "to-abort", "", PROMPTS[2], max_tokens=2000, ignore_eos=True), timeout_s=60)
            msgs = [await call.read(), await call.read()]
            aborted = await client.abort("to-abort")
            msgs += await asyncio.wait_for(_rest(call), timeout=10)  # today: hangs
            return aborted, msgs, await client.abort("to-abort"), await client.stats()

    aborted, msgs, again, stats = asyncio.run(go())
    assert aborted is True and again is False
    assert msgs[-1].finished and msgs[-1].finish_reason == "abort"
    assert stats.num_running == 0 and stats.num_kv_blocks_free == stats.num_kv_blocks_total


def test_abort_rpc_ends_a_decode_leg_waiting_for_kv(engine_server):
    transfer_id = "x-" + "a" * 126  # 128 characters: the limit, still accepted
    leg = dict(role="decode", mode="push", transfer_id=transfer_id, peer="127.0.0.1:9")

    async def go():
        async with EngineClient(engine_server) as client:
            call = client.generate(build_generate_request(
                "waiting", "", PROMPTS[1], max_tokens=4, kv_transfer=leg), timeout_s=60)
            stream = asyncio.ensure_future(_rest(call))
            await asyncio.sleep(0.3)  # admitted, waiting for a P that never comes
            aborted = await client.abort("waiting")
            return aborted, await asyncio.wait_for(stream, timeout=10)

    aborted, msgs = asyncio.run(go())
    assert aborted is True
    assert msgs[-1].finished and msgs[-1].finish_reason == "abort"
    stats = asyncio.run(_settled_stats(engine_server))
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
    assert stats.num_kv_transfers_active == 0


def test_over_long_ids_and_prompts_are_refused_without_a_traceback(engine_process):
    proc, address = engine_process
    leg = dict(role="decode", mode="push", transfer_id="x-" + "a" * 127, peer="127.0.0.1:9")

    async def go():
        async with EngineClient(address) as client:
            errors = []
            for req in (build_generate_request("long-id", "", PROMPTS[0], kv_transfer=leg),
                        build_generate_request("long-prompt", "", [1] * 5000),
                        build_generate_request("long-text", "x" * 5000)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await collect(client, req)
                errors.append((info.value.code(), info.value.details()))
            return errors

    errors = asyncio.run(go())
    assert all(code == grpc.StatusCode.INVALID_ARGUMENT for code, _ in errors)
    assert "transfer_id must be 1-128 characters, got 129" in errors[0][1]
    assert "limit" in errors[1][1] and "limit" in errors[2][1]
    proc.wait_for("request long-text refused", timeout_s=10)
    assert "Traceback" not in proc.output and " ERROR " not in proc.output


def test_bogus_kv_connections_cost_no_memory(engine_process):
    """Headers that promise 64 MiB bodies, from peers that never authenticate."""
    proc, address = engine_process
    host, _, port = asyncio.run(_health(address)).kv_endpoint.rpartition(":")
    before = _rss_bytes(proc.popen.pid)
    socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(8)]
    for i, sock in enumerate(socks):  # half a HELLO, half a WRITE: both want 64 MiB
        op = wire.OP_HELLO if i % 2 else wire.OP_WRITE
        sock.sendall(wire.HEADER.pack(op, 0, wire.MAX_TABLE_BYTES - 1))
    time.sleep(0.5)
    after = _rss_bytes(proc.popen.pid)
    started = time.monotonic()
    for sock in socks:
        while sock.recv(65536):
            pass  # the REFUSE frame, then EOF
        sock.close()
    closed_s = time.monotonic() - started
    print(f"engine RSS {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB; "
          f"all 8 closed {closed_s:.2f} s after the check")
    assert after - before < 4 << 20, (before, after)
    assert closed_s < 5.0  # the handshake deadline (5 s by default) at most
    proc.wait_for("refused KV connection from 127.0.0.1: oversized frame", timeout_s=5)
    assert "Traceback" not in proc.output


def test_sigterm_drains_then_removes_the_kv_segment():
    proc, address = start_engine("--num-kv-blocks", "4096", "--block-size", "8",
                                 "--kv-transport", "shm", "--shutdown-grace-s", "3")
    segments = glob.glob(f"/dev/shm/pdserve-kv-{proc.popen.pid}-*")
    assert len(segments) == 2  # the KV cache and the probes' scratch block

    async def go():
        async with EngineClient(address) as client:
            short = client.generate(build_generate_request(
                "short", "", PROMPTS[0], max_tokens=200, ignore_eos=True), timeout_s=60)
            endless = client.generate(build_generate_request(
                "endless", "", PROMPTS[1], max_tokens=30000, ignore_eos=True), timeout_s=60)
            first = [await short.read(), await endless.read()]
            signalled_s = time.monotonic()
            proc.signal(signal.SIGTERM)
            proc.wait_for("shutting down", timeout_s=5)
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await collect(client, build_generate_request("late", "", PROMPTS[0]))
            rest = await asyncio.gather(_rest(short), _rest(endless))
            return signalled_s, first, rest, late.value.code()

    signalled_s, first, (short, endless), late = asyncio.run(go())
    code = proc.popen.wait(30)
    stopped_s = time.monotonic() - signalled_s
    print(f"SIGTERM to exit: {stopped_s:.2f} s (grace 3 s)")
    assert code == 0
    assert late == grpc.StatusCode.UNAVAILABLE
    assert short[-1].finish_reason == "length"
    assert sum(len(m.token_ids) for m in [first[0], *short]) == 200  # finished in the grace
    assert endless[-1].finish_reason == "error" and "shut down" in endless[-1].error
    assert stopped_s < 3 + 5
    assert not glob.glob(f"/dev/shm/pdserve-kv-{proc.popen.pid}-*"), "KV segment left behind"
    assert "Traceback" not in proc.output and "pdserve engine stopped" in proc.output


def test_sigint_shuts_down_the_same_way():
    proc, address = start_engine("--num-kv-blocks", "32", "--kv-transport", "shm")
    assert glob.glob(f"/dev/shm/pdserve-kv-{proc.popen.pid}-*")
    started = time.monotonic()
    proc.signal(signal.SIGINT)
    assert proc.popen.wait(30) == 0
    print(f"SIGINT to exit (idle engine): {time.monotonic() - started:.2f} s")
    assert not glob.glob(f"/dev/shm/pdserve-kv-{proc.popen.pid}-*")
    assert "Traceback" not in proc.output and "pdserve engine stopped" in proc.output


async def _rest(call) -> list:
    """What is left of a stream, read the way its first messages were (``read``)."""
    msgs = []
    while (m := await call.read()) is not grpc.aio.EOF:
        msgs.append(m)
    return msgs


async def _health(address):
    async with EngineClient(address) as client:
        return await client.health()


async def _settled_stats(address, timeout_s: float = 10.0):
    async with EngineClient(address) as client:
        deadline = time.monotonic() + timeout_s
        while True:
            stats = await client.stats()
            done = stats.num_kv_blocks_free == stats.num_kv_blocks_total
            if (done and stats.num_kv_transfers_active == 0) or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.1)


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")
