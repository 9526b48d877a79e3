"""The simulated engine: its steps take the time its model gives them, sleeping, and it
generates a fixed text through the real scheduler, without loading torch."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdserve.api.sampling import SamplingParams
from pdserve.engine.admission import EngineInputError
from pdserve.engine.cli_args import engine_config_from_args
from pdserve.engine.cli_serve import add_arguments, engine_configs
from pdserve.engine.config import ConfigError, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sim import SIM_TEXT, SimTiming
from tests.procs import REPO

TIMING = SimTiming(prefill_base_s=0.040, prefill_per_token_s=0.0005, decode_base_s=0.030,
                   decode_per_seq_s=0.004, decode_per_kv_token_s=0.0001)


def sim_engine(timing: SimTiming = TIMING, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", simulate=timing, **config))


def test_the_model_adds_up_prefill_and_decode_terms():
    t = TIMING
    assert t.step_s(0, 0, 0) == 0.0
    assert t.step_s(100, 0, 0) == pytest.approx(0.040 + 0.05)
    assert t.step_s(0, 3, 300) == pytest.approx(0.030 + 0.012 + 0.03)
    # A mixed step pays the prefill's fixed cost, not both.
    assert t.step_s(100, 3, 300) == pytest.approx(0.040 + 0.05 + 0.012 + 0.03)


def test_each_step_sleeps_what_the_model_gives_the_scheduled_batch():
    engine = sim_engine()
    slept: list[float] = []
    engine.runner.sleep = slept.append
    engine.add_request("a", list(range(1, 101)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("b", list(range(1, 61)), SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    # Step 1 prefills both prompts (160 tokens, one chunk); then both decode together
    # with 101 + 61, then 102 + 62 tokens of context.
    assert slept == pytest.approx([
        TIMING.step_s(160, 0, 0), TIMING.step_s(0, 2, 162), TIMING.step_s(0, 2, 164)])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_real_step_takes_the_modelled_time_sleeping_not_computing():
    engine = sim_engine()
    engine.add_request("a", list(range(1, 201)), SamplingParams(max_tokens=5, ignore_eos=True))
    # this thread's CPU time: the step runs here, while the process may hold other
    # tests' threads that burn CPU of their own
    wall, cpu = time.perf_counter(), time.thread_time()
    engine.step()  # 200 prompt tokens: 40 + 100 ms
    prefill_s = time.perf_counter() - wall
    wall = time.perf_counter()
    engine.step()  # one decode, 201 tokens of context: 30 + 4 + 20.1 ms
    decode_s = time.perf_counter() - wall
    busy_s = time.thread_time() - cpu
    assert TIMING.step_s(200, 0, 0) <= prefill_s < TIMING.step_s(200, 0, 0) + 0.1
    assert TIMING.step_s(0, 1, 201) <= decode_s < TIMING.step_s(0, 1, 201) + 0.1
    assert busy_s < 0.5 * (prefill_s + decode_s)  # slept, not spun


def test_it_generates_the_fixed_text_and_a_continued_stream_goes_on_where_it_stopped():
    engine = sim_engine(SimTiming(0, 0, 0, 0, 0))
    [out] = engine.generate([[72, 105]], SamplingParams(max_tokens=12))
    assert engine.tokenizer.decode(out) == SIM_TEXT[:12]
    [more] = engine.generate([[72, 105]], SamplingParams(max_tokens=4, sample_offset=12))
    assert engine.tokenizer.decode(more) == SIM_TEXT[12:16]


def test_it_refuses_what_it_cannot_simulate():
    engine = sim_engine()
    with pytest.raises(EngineInputError, match="simulated engine does not run constrained"):
        engine.add_request("g", [1, 2], SamplingParams(guided=("regex", "a+")))
    with pytest.raises(ConfigError, match="kv_transport tcp or none"):
        sim_engine(kv_transport="shm")
    with pytest.raises(ConfigError, match="prefill_base_s must be at least 0"):
        sim_engine(SimTiming(prefill_base_s=-1.0))


def test_its_kv_budget_gives_the_modelled_models_block_count():
    # small: 8 layers, 2 KV heads of 64, float32: 8 KiB per token, 128 KiB per block.
    engine = LLMEngine(EngineConfig(model="small", kv_cache_bytes=64 << 20, simulate=SimTiming()))
    assert engine.block_manager.num_blocks == 512
    assert engine.stats().kv_cache_bytes == 64 << 20


def test_the_flags_set_the_model():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = engine_config_from_args(parser.parse_args(
        ["--simulate", "--sim-prefill-per-token-ms", "0.25", "--sim-decode-per-kv-token-us", "1"]))
    assert config.simulate == SimTiming(prefill_per_token_s=0.00025, decode_per_kv_token_s=1e-6)
    assert engine_config_from_args(parser.parse_args([])).simulate is None


def test_roles_make_one_simulated_engine_each_on_ports_of_its_own():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    configs = engine_configs(parser.parse_args(["--simulate", "--roles", "prefill,decode,decode"]))
    assert [c.role for c in configs] == ["prefill", "decode", "decode"]
    assert {c.kv_port for c in configs} == {0}  # each a free one
    configs = engine_configs(parser.parse_args(["--simulate", "--roles", "decode,decode", "--kv-port", "7000"]))
    assert [c.kv_port for c in configs] == [7000, 7001]
    assert len(engine_configs(parser.parse_args(["--simulate"]))) == 1
    with pytest.raises(ConfigError, match="only simulated engines"):
        engine_configs(parser.parse_args(["--roles", "prefill,decode"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--simulate", "--roles", "prefill,nosuch"])


@pytest.mark.asyncio
async def test_engines_served_by_one_process_have_servers_of_their_own_and_stop_together():
    import asyncio
    import socket

    from pdserve.engine.server import serve
    from pdserve.runtime.engine_client import EngineClient

    engines = [LLMEngine(EngineConfig(model="small", kv_transport="tcp", role=role, simulate=SimTiming()))
               for role in ("prefill", "decode")]
    ports: list[tuple[int, int]] = []
    serving = asyncio.create_task(serve(engines, "127.0.0.1", 0, lambda i, port: ports.append((i, port))))
    try:
        for _ in range(200):
            if len(ports) == 2:
                break
            await asyncio.sleep(0.02)
        assert [i for i, _ in ports] == [0, 1] and ports[0][1] != ports[1][1]
        healths = []
        for _, port in ports:
            async with EngineClient(f"127.0.0.1:{port}") as client:
                healths.append(await client.health(5))
        assert [h.role for h in healths] == ["prefill", "decode"]
        assert len({h.kv_endpoint for h in healths}) == 2 and len({h.session_port for h in healths}) == 2
    finally:
        serving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving
    kv_ports = [int(h.kv_endpoint.rsplit(":", 1)[1]) for h in healths]
    for port in [p for _, p in ports] + kv_ports:  # both servers and both KV transports stopped
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            pass


def test_a_signal_once_the_first_of_several_engines_serves_shuts_them_all_down_in_order():
    import signal

    from tests.procs import PDSERVE, Proc

    proc = Proc([*PDSERVE, "engine", "--simulate", "--model", "small", "--port", "0",
                 "--metrics-port", "0", "--roles", ",".join(["decode"] * 20)])
    try:
        proc.wait_for(r"pdserve engine 0 \(decode\) serving model", timeout_s=60)
        proc.signal(signal.SIGTERM)  # the other 19 are still starting
        assert proc.popen.wait(30) == 0
    finally:
        proc.stop()
    assert "pdserve engine stopped" in proc.output and "interrupted" not in proc.output
    assert "Traceback" not in proc.output


def test_a_simulated_engine_and_its_server_never_import_torch():
    code = ("import sys; from pdserve.engine.server import serve; "
            "from pdserve.engine.config import EngineConfig; from pdserve.engine.sim import SimTiming; "
            "from pdserve.engine.llm_engine import LLMEngine; "
            "LLMEngine(EngineConfig(model='small', kv_transport='tcp', simulate=SimTiming())).close(); "
            "print('torch' in sys.modules, 'llguidance' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
