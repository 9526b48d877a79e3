"""Partial transfer: D takes a prompt's leading blocks from its own prefix cache and
P moves only the rest. In every mode over every transport the bytes moved are the
missing tokens' exactly, the output equals one hybrid engine's, D's KV equals what a
full transfer gives, and every block comes back (refcounts balanced)."""

from __future__ import annotations

import pytest
import torch

from pdserve.api.sampling import SamplingParams
from tests.unit.engine.pd_harness import (
    MODES,
    TRANSPORTS,
    assert_all_free,
    make_engine,
    prompt_kv,
    run_until_idle,
    submit_pair,
    tokens,
)

BS = 8

def _prompts(mode: str) -> tuple[list[int], list[int], list[int]]:
    """A shared start of five full blocks (a system prompt) and two requests over it,
    distinct per mode, so each test starts with nothing of them in D's cache."""
    base = 1 + 80 * MODES.index(mode)
    shared = list(range(base, base + 40))
    return shared, shared + [300, 301, 302], shared + [310 + i for i in range(10)]


def _bytes_moved(p, d, mode) -> int:
    return (d if mode == "pull" else p).stats().kv_transfer_bytes


def _token_bytes(engine) -> int:
    kv = engine.runner.kv_cache
    return kv.shape[0] * 2 * kv.shape[-2] * kv.shape[-1] * kv.element_size()


@pytest.fixture(scope="module")
def hybrid():
    return make_engine("hybrid", transport="none")


@pytest.fixture(scope="module", params=[(t, partial) for t in TRANSPORTS for partial in (True, False)],
                ids=lambda v: f"{v[0]}-{'partial' if v[1] else 'full'}")
def pair(request):
    transport, partial = request.param
    p = make_engine("prefill", transport)
    d = make_engine("decode", transport, kv_partial_transfer=partial)
    yield p, d, partial
    p.close()
    d.close()


@pytest.mark.parametrize("mode", MODES)
def test_only_the_blocks_d_lacks_are_moved(hybrid, pair, mode):
    p, d, partial = pair
    shared, first_prompt, second_prompt = _prompts(mode)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = hybrid.generate([first_prompt, second_prompt], params)
    start = _bytes_moved(p, d, mode)
    submit_pair(p, d, f"first-{mode}", first_prompt, params, mode)
    first = run_until_idle(p, d)
    before = _bytes_moved(p, d, mode)
    assert before - start == len(first_prompt) * _token_bytes(p)
    exposed = {}

    def capture(engine, out):
        if engine is d and out.num_output_tokens == 1 and not out.finished:
            req = next(r for r in d.scheduler.running if r.request_id == out.request_id)
            exposed["kv"] = prompt_kv(d, req.block_table, req.num_prompt_tokens)
            exposed["cached"] = out.num_cached_tokens

    submit_pair(p, d, f"second-{mode}", second_prompt, params, mode)
    second = run_until_idle(p, d, on_outputs=capture)
    moved = _bytes_moved(p, d, mode) - before
    skipped = len(shared) if partial else 0  # all five shared blocks are in D's cache
    assert moved == (len(second_prompt) - skipped) * _token_bytes(p)
    assert exposed["cached"] == skipped
    assert tokens(first[f"d-first-{mode}"]) == expected[0]
    assert tokens(second[f"d-second-{mode}"]) == expected[1]
    torch.testing.assert_close(exposed["kv"], _hybrid_kv(hybrid, second_prompt), atol=1e-5, rtol=1e-5)
    assert_all_free(p, d)


def _hybrid_kv(engine, prompt):
    req = engine.add_request("kv", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    while not req.output_token_ids:
        engine.step()
    kv = prompt_kv(engine, req.block_table, len(prompt))
    engine.abort_request("kv")
    return kv
