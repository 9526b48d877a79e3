"""The shared KV pool on a real Mooncake Store master: a prompt computed by one engine
is a cache hit on another (fetched, not recomputed: same output, same KV bytes,
blocks balanced), and a pool that is gone is a cache miss, never an error."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from pdserve.api.sampling import SamplingParams
from pdserve.engine import kv_pool
from pdserve.engine.config import ConfigError, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from tests.kv_pool import PoolMaster
from tests.procs import Proc
from tests.unit.engine.pd_harness import assert_all_free, prompt_kv

PROMPT = list(range(3, 70))  # eight full blocks of 8 and three tokens
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.fixture
def master():
    m = PoolMaster().start()
    yield m
    m.stop()


def _engine(pool: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", num_kv_blocks=32, block_size=8, kv_pool=pool,
                                  kv_pool_segment_bytes=32 << 20))


def _run(engine: LLMEngine, rid: str, prompt: list[int]):
    req = engine.add_request(rid, prompt, PARAMS)
    kv = None
    while not req.is_finished:
        engine.step()
        if kv is None and req.output_token_ids:
            kv = prompt_kv(engine, req.block_table, len(prompt))
    return list(req.output_token_ids), req.num_cached_tokens, kv


def test_a_prompt_computed_on_one_engine_is_a_hit_on_another(master):
    a, b = _engine(master.address), _engine(master.address)
    try:
        out_a, cached_a, kv_a = _run(a, "a", PROMPT)
        assert cached_a == 0
        a.kv_pool.flush()
        assert a.kv_pool.stats.num_puts == 8  # every full block of the prompt
        out_b, cached_b, kv_b = _run(b, "b", PROMPT)
        assert cached_b == 64  # all eight blocks came from the pool
        assert out_b == out_a
        # The fetched blocks hold a's bytes exactly; b computed only the last 3 tokens.
        assert torch.equal(kv_b[:, :, :64], kv_a[:, :, :64])
        torch.testing.assert_close(kv_b, kv_a, atol=1e-5, rtol=1e-5)
        assert b.kv_pool.stats.num_hits == 8 and b.kv_pool.stats.bytes_fetched > 0
        assert b.kv_pool.stats.num_puts == 0  # fetched blocks are not put back
        # A second prompt sharing the first five blocks: local hits on b, nothing fetched.
        _, cached, _ = _run(b, "b2", PROMPT[:40] + [200, 201, 202])
        assert cached == 40 and b.kv_pool.stats.num_hits == 8
        assert_all_free(a, b)
    finally:
        a.close()
        b.close()


def gone_scenario(address: str, master_gone: str) -> None:
    """The engine's side of ``test_a_pool_that_is_gone_is_a_cache_miss``, in a process of
    its own (as engines are): a client of a dead master keeps threads that reconnect
    forever, which must not stay in the test process. Prints what the test checks."""
    a = _engine(address)
    reference, _, _ = _run(a, "a", PROMPT)
    a.kv_pool.flush()
    print("puts done", flush=True)
    deadline = time.monotonic() + 60
    while not Path(master_gone).exists():  # the test stops the master, then says so
        assert time.monotonic() < deadline, "the test did not stop the master"
        time.sleep(0.05)
    deadline = time.monotonic() + 10
    while a.kv_pool.is_up:  # the pool's own check finds the master gone
        assert time.monotonic() < deadline, "the pool still looks up"
        time.sleep(0.1)
    out, cached, _ = _run(a, "after", [t + 100 for t in PROMPT])  # computed, no error
    again = _run(a, "again", PROMPT)[0]  # its own cache still serves
    assert_all_free(a)
    s = a.kv_pool.stats
    print(json.dumps({"cached": cached, "num_out": len(out), "num_down": s.num_down,
                      "num_puts": s.num_puts, "same": again == reference}), flush=True)
    os._exit(0)  # the client of the dead master is not closed: its close waits for it


def test_a_pool_that_is_gone_is_a_cache_miss(master, tmp_path):
    flag = tmp_path / "master-gone"
    engine = Proc([sys.executable, "-c", "import sys; from tests.unit.engine.test_kv_pool import "
                   "gone_scenario; gone_scenario(*sys.argv[1:])", master.address, str(flag)])
    try:
        engine.wait_for("puts done", timeout_s=120)
        master.stop()
        flag.touch()
        result = json.loads(engine.wait_for(r"^\{.*\}$", timeout_s=120).group(0))
        assert engine.popen.wait(30) == 0
    finally:
        engine.stop()
    assert result == {"cached": 0, "num_out": 5, "num_down": 1, "num_puts": 8, "same": True}


def test_an_engine_without_a_reachable_master_refuses_to_start(monkeypatch):
    monkeypatch.setattr(kv_pool, "JOIN_WAIT_S", 1.0)  # it waits this long for a master to listen
    with pytest.raises(RuntimeError, match=r"cannot join the KV pool .* \(waited 1s\)"):
        _engine("127.0.0.1:1")


def test_the_pool_refuses_what_it_cannot_hold():
    with pytest.raises(ConfigError, match="tensor parallelism"):
        LLMEngine(EngineConfig(model="tiny", num_kv_blocks=8, kv_pool="127.0.0.1:1",
                               tensor_parallel_size=2))
