"""The scheduler under load, end to end on the ``tiny`` preset.

Every test runs a workload that exercises one scheduler path (batching, chunked
prefill, prefix hits, preemption, the running cap, abort) and checks that greedy
outputs equal the same prompts run one at a time on a fresh engine, then that
nothing leaked.
"""

from __future__ import annotations

import random

import pytest

from pdserve.api.sampling import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import RequestStatus

BLOCK_SIZE = 8


def make_engine(**overrides) -> LLMEngine:
    settings = dict(model="tiny", block_size=BLOCK_SIZE, num_kv_blocks=256)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def make_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def run_alone(prompt: list[int], max_tokens: int) -> list[int]:
    """The reference: one prompt on a fresh engine with plenty of room."""
    engine = make_engine()
    [out] = engine.generate([prompt], greedy(max_tokens))
    assert_no_leak(engine)
    return out


def assert_no_leak(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.scheduler.waiting
    assert not engine.scheduler.running
    assert not engine.requests
    assert not engine.has_unfinished


def record_batches(engine: LLMEngine) -> list:
    """Wrap the scheduler so the test sees every batch and the running set after it."""
    seen = []
    schedule = engine.scheduler.schedule

    def spy():
        batch = schedule()
        seen.append((list(batch.items), len(engine.scheduler.running)))
        return batch

    engine.scheduler.schedule = spy
    return seen


def run_all(engine: LLMEngine, prompts, max_tokens) -> list[list[int]]:
    max_tokens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    return engine.generate(prompts, [greedy(n) for n in max_tokens])


def test_batching_matches_one_at_a_time():
    lengths = [1, 3, 7, 8, 9, 15, 16, 17, 33, 40]
    prompts = [make_prompt(n, seed=n) for n in lengths]
    max_tokens = [5 + (i * 3) % 11 for i in range(len(prompts))]
    engine = make_engine()
    seen = record_batches(engine)
    outputs = run_all(engine, prompts, max_tokens)
    assert max(len(items) for items, _ in seen) == len(prompts)  # really batched
    for prompt, n, out in zip(prompts, max_tokens, outputs, strict=True):
        assert len(out) == n
        assert out == run_alone(prompt, n)
    assert_no_leak(engine)


def test_chunked_prefill_matches_one_at_a_time():
    prompts = [make_prompt(n, seed=100 + n) for n in (45, 70, 5)]
    engine = make_engine(max_num_batched_tokens=16)
    seen = record_batches(engine)
    outputs = run_all(engine, prompts, 12)
    assert all(sum(n for _, n in items) <= 16 for items, _ in seen)
    chunk_sizes = [n for items, _ in seen for _, n in items if n > 1]
    assert len(chunk_sizes) >= (45 + 70) // 16  # long prompts took several steps
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out == run_alone(prompt, 12)
    assert_no_leak(engine)


def test_prefix_cache_hit_gives_the_same_output():
    prefix = make_prompt(48, seed=7)
    first, second = prefix + [1, 2, 3], prefix + [200, 201]
    engine = make_engine()
    assert run_all(engine, [first], 6)[0] == run_alone(first, 6)
    hits_before = engine.stats().prefix_cache_hit_tokens

    req = engine.add_request("second", second, greedy(10))
    while engine.has_unfinished:
        engine.step()
    assert req.num_cached_tokens == 48
    assert engine.stats().prefix_cache_hit_tokens == hits_before + 48
    assert req.output_token_ids == run_alone(second, 10)
    assert_no_leak(engine)


def test_prefix_shared_with_a_live_request():
    prefix = make_prompt(40, seed=8)
    engine = make_engine()
    a = engine.add_request("a", prefix + [9], greedy(20))
    engine.step()  # a's prompt is computed and its full blocks published
    b = engine.add_request("b", prefix + [10, 11], greedy(20))
    engine.step()
    assert b.num_cached_tokens == 40
    assert b.block_table[:5] == a.block_table[:5]
    while engine.has_unfinished:
        engine.step()
    assert a.output_token_ids == run_alone(prefix + [9], 20)
    assert b.output_token_ids == run_alone(prefix + [10, 11], 20)
    assert_no_leak(engine)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes_to_the_same_output(prefix_caching):
    prompts = [make_prompt(20 + i, seed=300 + i) for i in range(4)]
    # Each request needs up to 8 blocks; 12 blocks cannot hold four at once.
    engine = make_engine(num_kv_blocks=12, enable_prefix_caching=prefix_caching)
    outputs = run_all(engine, prompts, 40)
    assert engine.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out == run_alone(prompt, 40)
    assert_no_leak(engine)


def test_max_num_seqs_is_respected_every_step():
    prompts = [make_prompt(5 + 3 * i, seed=400 + i) for i in range(8)]
    engine = make_engine(max_num_seqs=3)
    seen = record_batches(engine)
    outputs = run_all(engine, prompts, 8)
    assert all(len(items) <= 3 and num_running <= 3 for items, num_running in seen)
    assert max(num_running for _, num_running in seen) == 3
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out == run_alone(prompt, 8)
    assert_no_leak(engine)


def test_abort_mid_generation_frees_blocks_and_is_idempotent():
    prompts = {rid: make_prompt(30, seed=500 + i) for i, rid in enumerate("abc")}
    engine = make_engine(max_num_seqs=2)
    reqs = {rid: engine.add_request(rid, p, greedy(30)) for rid, p in prompts.items()}
    for _ in range(5):
        engine.step()
    a = reqs["a"]
    assert a.status is RequestStatus.RUNNING and 0 < len(a.output_token_ids) < 30
    used_before = engine.block_manager.num_used_blocks

    assert engine.abort_request("a") is True
    assert a.status is RequestStatus.FINISHED_ABORTED and a.block_table == []
    assert engine.block_manager.num_used_blocks < used_before
    assert a not in engine.scheduler.running
    assert engine.abort_request("a") is False
    assert engine.abort_request("never-added") is False
    assert a.status is RequestStatus.FINISHED_ABORTED

    # c is still waiting (cap of two): aborting it holds no blocks and ends it too.
    assert reqs["c"].status is RequestStatus.WAITING
    engine.step()  # c admitted now that a left
    assert engine.abort_request("c") is True
    while engine.has_unfinished:
        engine.step()
    assert reqs["b"].output_token_ids == run_alone(prompts["b"], 30)
    assert reqs["c"].status is RequestStatus.FINISHED_ABORTED
    assert_no_leak(engine)


def test_abort_of_a_waiting_request():
    engine = make_engine(max_num_seqs=1)
    engine.add_request("a", make_prompt(10, seed=1), greedy(4))
    waiting = engine.add_request("b", make_prompt(10, seed=2), greedy(4))
    engine.step()
    assert waiting.status is RequestStatus.WAITING
    assert engine.abort_request("b") is True
    assert engine.abort_request("b") is False
    while engine.has_unfinished:
        engine.step()
    assert_no_leak(engine)
