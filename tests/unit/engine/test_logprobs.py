"""Log probabilities: sampled tokens' and prompt tokens', against transformers' log-softmax,
through chunked prefill, prefix-cache hits, sampling controls and a P/D pair."""

from __future__ import annotations

import pytest
import torch

from pdserve.api.proto import engine_pb2 as pb
from pdserve.api.sampling import SamplingParams
from pdserve.engine.admission import EngineInputError
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_transfer.params import KVTransferParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.output import RequestOutput
from pdserve.engine.request import TokenLogprob
from pdserve.engine.server import output_to_proto, sampling_from_proto
from tests.unit.engine.hf_models import build_hf_model, save_hf_model
from tests.unit.engine.pd_harness import (
    assert_all_free,
    make_engine,
    run_until_idle,
    submit_pair,
    tokens,
)

PROMPT = [5, 17, 99, 3, 250, 42, 42, 7, 64, 128, 1, 300, 11, 23, 8, 19, 77, 140, 2, 33]
TOP = 5


@pytest.fixture(scope="module")
def hf_and_engine(tmp_path_factory):
    """A random llama checkpoint and an engine over it that prefills in chunks of 8."""
    path = tmp_path_factory.mktemp("llama")
    hf = build_hf_model("llama", seed=3)
    save_hf_model(hf, path)
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64, block_size=4,
                                    prefill_chunk_tokens=8, max_num_batched_tokens=16))
    return hf, engine


def run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams):
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished:
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of ``token_ids``: [T, V]."""
    with torch.no_grad():
        logits = hf(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_entry(entry, ref_row: torch.Tensor, token_id: int, num_top: int) -> None:
    assert entry.token_id == token_id
    assert entry.logprob == pytest.approx(float(ref_row[token_id]), abs=2e-4)
    ref_top = torch.topk(ref_row, num_top)
    assert [t for t, _ in entry.top] == ref_top.indices.tolist()
    assert [lp for _, lp in entry.top] == pytest.approx(ref_top.values.tolist(), abs=2e-4)


def test_sampled_and_prompt_logprobs_equal_transformers(hf_and_engine):
    hf, engine = hf_and_engine
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=TOP,
                            prompt_logprobs=True)
    outs = run(engine, "greedy", PROMPT, params)
    out_ids = tokens(outs)
    ref = hf_logprobs(hf, PROMPT + out_ids)
    prompt_lps = outs[0].prompt_logprobs  # with the first token, once
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert len(prompt_lps) == len(PROMPT) - 1
    for i, entry in enumerate(prompt_lps):  # position i predicts prompt token i + 1
        assert_entry(entry, ref[i], PROMPT[i + 1], TOP)
    sampled = [e for o in outs for e in o.logprobs]
    assert len(sampled) == len(out_ids)
    for j, entry in enumerate(sampled):
        assert_entry(entry, ref[len(PROMPT) - 1 + j], out_ids[j], TOP)
        assert entry.top[0][0] == entry.token_id  # greedy draws the likeliest
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_logprobs_are_of_the_raw_distribution_whatever_the_sampling(hf_and_engine):
    hf, engine = hf_and_engine
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.7, top_k=40, seed=9,
                            repetition_penalty=1.3, logit_bias={7: 3.0}, logprobs=True)
    outs = run(engine, "sampled", PROMPT, params)
    out_ids = tokens(outs)
    ref = hf_logprobs(hf, PROMPT + out_ids)
    sampled = [e for o in outs for e in o.logprobs]
    assert [e.token_id for e in sampled] == out_ids
    for j, entry in enumerate(sampled):
        assert entry.logprob == pytest.approx(float(ref[len(PROMPT) - 1 + j, out_ids[j]]), abs=2e-4)
        assert entry.top == []  # top_logprobs=0: the sampled token only
    assert all(o.prompt_logprobs is None for o in outs)


def test_prompt_logprobs_skip_the_prefix_cache(hf_and_engine):
    hf, engine = hf_and_engine
    run(engine, "warm", PROMPT, SamplingParams(max_tokens=1))  # publishes the prompt's blocks
    hits_before = engine.block_manager.num_prefix_hit_tokens
    cached = run(engine, "cached", PROMPT, SamplingParams(max_tokens=1))
    assert cached[-1].num_cached_tokens > 0  # the prompt is in the cache
    outs = run(engine, "scored", PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=True))
    assert outs[-1].num_cached_tokens == 0  # computed again: cached positions have no logits
    assert engine.block_manager.num_prefix_hit_tokens == hits_before + cached[-1].num_cached_tokens
    ref = hf_logprobs(hf, PROMPT)
    entries = outs[0].prompt_logprobs
    assert [e.token_id for e in entries] == PROMPT[1:]
    assert [e.logprob for e in entries] == pytest.approx(
        [float(ref[i, PROMPT[i + 1]]) for i in range(len(PROMPT) - 1)], abs=2e-4)


def test_a_preempted_prefill_scores_each_prompt_token_once(hf_and_engine):
    hf, engine = hf_and_engine
    request = engine.add_request("preempted", PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=True))
    engine.step()  # the first chunk of 8 positions is scored
    assert len(request.prompt_logprobs) == 8
    engine.scheduler.running.remove(request)
    engine.scheduler._preempt(request)  # what a block shortage does: recompute from scratch
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    ref = hf_logprobs(hf, PROMPT)
    scored = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(scored) == 1 and [e.token_id for e in scored[0]] == PROMPT[1:]
    assert [e.logprob for e in scored[0]] == pytest.approx(
        [float(ref[i, PROMPT[i + 1]]) for i in range(len(PROMPT) - 1)], abs=2e-4)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_requests_without_logprobs_report_none(hf_and_engine):
    _, engine = hf_and_engine
    outs = run(engine, "plain", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in outs)


def test_top_logprobs_beyond_the_limit_is_refused(hf_and_engine):
    _, engine = hf_and_engine
    with pytest.raises(EngineInputError, match=r"top_logprobs must be in \[0, 20\]"):
        engine.add_request("too-many", PROMPT, SamplingParams(logprobs=True, top_logprobs=21))


def test_pd_pair_logprobs_come_from_the_engine_that_sampled():
    """P scores the prompt and its first token; D the tokens it samples; D's first token
    (P's) has no entry on D. Together they equal one hybrid engine's."""
    hybrid = make_engine("hybrid", transport="none")
    p, d = make_engine("prefill"), make_engine("decode")
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, seed=5,
                            logprobs=True, top_logprobs=2)
    prompt = list(range(3, 40))
    try:
        whole = run(hybrid, "h", prompt, SamplingParams(**{**params.__dict__, "prompt_logprobs": True}))
        with pytest.raises(EngineInputError, match="prompt_logprobs"):
            d.add_request("bad", prompt, SamplingParams(prompt_logprobs=True), kv_transfer=
                          KVTransferParams("decode", "push", "x-bad", p.connector.endpoint))
        d.add_request("d-r", prompt, params,
                      kv_transfer=KVTransferParams("decode", "push", "x-r", p.connector.endpoint))
        p.add_request("p-r", prompt, SamplingParams(**{**params.__dict__, "prompt_logprobs": True}),
                      kv_transfer=KVTransferParams("prefill", "push", "x-r", d.connector.endpoint))
        outs = run_until_idle(p, d)
        p_outs, d_outs = outs["p-r"], outs["d-r"]
        assert tokens(d_outs) == tokens(whole)
        p_first = p_outs[0]
        assert p_first.new_token_ids == tokens(whole)[:1] and len(p_first.logprobs) == 1
        assert d_outs[0].new_token_ids == tokens(whole)[:1] and d_outs[0].logprobs == []
        assert all(o.prompt_logprobs is None for o in d_outs)
        merged = p_first.logprobs + [e for o in d_outs[1:] for e in o.logprobs]
        expected = [e for o in whole for e in o.logprobs]
        assert [e.token_id for e in merged] == [e.token_id for e in expected]
        assert [e.logprob for e in merged] == pytest.approx([e.logprob for e in expected], abs=1e-5)
        assert [[t for t, _ in e.top] for e in merged] == [[t for t, _ in e.top] for e in expected]
        assert [e.logprob for e in p_first.prompt_logprobs] == pytest.approx(
            [e.logprob for e in whole[0].prompt_logprobs], abs=1e-5)
        assert_all_free(p, d, hybrid)
    finally:
        p.close()
        d.close()


def test_submit_pair_without_logprobs_is_unchanged():
    """The pair harness' plain path still reports no logprobs (nothing asked, nothing done)."""
    p, d = make_engine("prefill"), make_engine("decode")
    try:
        submit_pair(p, d, "plain", [4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=3), "pull")
        outs = run_until_idle(p, d)
        assert all(o.logprobs is None for o in outs["p-plain"] + outs["d-plain"])
        assert_all_free(p, d)
    finally:
        p.close()
        d.close()


def test_the_wire_carries_logprobs_both_ways():
    msg = pb.SamplingParams(max_tokens=3, logprobs=True, top_logprobs=4, prompt_logprobs=True)
    params = sampling_from_proto(msg, has_sampling=True)
    assert (params.logprobs, params.top_logprobs, params.prompt_logprobs) == (True, 4, True)
    with pytest.raises(ValueError, match=r"n > 1 is not supported yet \(got 2\)"):
        sampling_from_proto(pb.SamplingParams(n=2), has_sampling=True)
    assert sampling_from_proto(pb.SamplingParams(n=1), has_sampling=True).max_tokens == 16
    entry = TokenLogprob(7, -0.5, [(7, -0.5), (9, -1.25)])
    out = RequestOutput("r", [7], "", False, None, 3, 1, 0, logprobs=[entry],
                        prompt_logprobs=[TokenLogprob(2, -3.0, [])])
    wire = output_to_proto(out)
    assert [(e.token_id, e.logprob) for e in wire.logprobs] == [(7, -0.5)]
    assert [(t.token_id, t.logprob) for t in wire.logprobs[0].top] == [(7, -0.5), (9, -1.25)]
    assert [(e.token_id, e.logprob, len(e.top)) for e in wire.prompt_logprobs] == [(2, -3.0, 0)]
    plain = output_to_proto(RequestOutput("r", [7], "", False, None, 3, 1, 0))
    assert not plain.logprobs and not plain.prompt_logprobs
