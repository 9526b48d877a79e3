"""Logit bias, min-p and the three penalties: their arithmetic on one row of logits,
their effect on the ``tiny`` preset, the wire conversion, and a penalized stream
continued on another engine drawing what the uncut stream draws.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.api.proto import engine_pb2 as pb
from pdserve.api.sampling import SamplingError, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampler import TokenHistory, argmax, sample
from pdserve.engine.server import sampling_from_proto

PROMPT = [5, 9, 200, 31, 7, 77, 140, 9, 9]


def make_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", num_kv_blocks=64))


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=16, ignore_eos=True, **kw)


# -- one row of logits --------------------------------------------------------------


def test_greedy_takes_the_first_of_equal_largest_logits_as_argmax():
    inf = float("inf")
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [-inf, -inf, -inf, -inf], [0.0, 0.0, 5.0, 5.0]])
    assert argmax(logits).tolist() == [1, 0, 2] == logits.argmax(-1).tolist()
    assert int(argmax(logits[2])) == 2
    ties = torch.randint(0, 4, (16, 4096)).float()  # thousands of equal maxima a row
    assert torch.equal(argmax(ties), ties.argmax(-1))
    assert sample(logits, [greedy()] * 3, [0, 0, 0]) == [1, 0, 2]


def test_logit_bias_moves_a_greedy_choice():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]])
    assert sample(logits, [SamplingParams()], [0]) == [0]
    assert sample(logits, [SamplingParams(logit_bias={2: 5.0})], [0]) == [2]
    assert logits[0, 2] == 0.0  # the caller's logits are not changed


def test_penalties_follow_vllm_arithmetic():
    logits = torch.tensor([[2.0, -2.0, 1.9, 0.5]])
    # Repetition: seen tokens 0 and 1 (prompt or output); positive / 2, negative * 2.
    rep = SamplingParams(repetition_penalty=2.0)
    history = TokenHistory(all_token_ids=[0, 1], generated_token_ids=[])
    assert sample(logits, [rep], [0], histories=[history]) == [2]  # 2.0 / 2 < 1.9
    # Frequency counts each generated occurrence, presence once; prompt tokens not at all.
    history = TokenHistory(all_token_ids=[2, 0, 0, 0], generated_token_ids=[0, 0, 0])
    freq = SamplingParams(frequency_penalty=0.1)
    assert sample(logits, [freq], [0], histories=[history]) == [2]  # 2.0 - 0.3 < 1.9
    pres = SamplingParams(presence_penalty=0.05)
    assert sample(logits, [pres], [0], histories=[history]) == [0]  # 2.0 - 0.05 > 1.9
    prompt_only = TokenHistory(all_token_ids=[0, 0, 0], generated_token_ids=[])
    assert sample(logits, [freq], [0], histories=[prompt_only]) == [0]


def test_min_p_keeps_only_likely_tokens():
    logits = torch.tensor([[5.0, 4.9, -5.0, -5.0]])
    params = [SamplingParams(temperature=1.0, seed=s, min_p=0.5) for s in range(40)]
    drawn = set(sample(logits.expand(40, -1), params, [0] * 40))
    assert drawn == {0, 1}


def test_out_of_range_values_are_refused_with_the_field():
    with pytest.raises(SamplingError, match="logit_bias out of vocabulary"):
        SamplingParams(logit_bias={400: 1.0}).validate(vocab_size=320)
    for field, value in (("min_p", 1.5), ("presence_penalty", 3.0),
                         ("frequency_penalty", -2.5), ("repetition_penalty", 0.0)):
        with pytest.raises(SamplingError, match=field):
            SamplingParams(**{field: value}).validate()


def test_wire_conversion_carries_every_control():
    msg = pb.SamplingParams(max_tokens=5, top_k=7, min_p=0.25, presence_penalty=0.5,
                            frequency_penalty=-0.5, repetition_penalty=1.5,
                            logit_bias={3: -100.0}, stop_token_ids=[9])
    params = sampling_from_proto(msg, True)
    assert (params.top_k, params.min_p, params.presence_penalty, params.frequency_penalty,
            params.repetition_penalty, params.logit_bias, params.stop_token_ids) == (
        7, 0.25, 0.5, -0.5, 1.5, {3: -100.0}, [9])
    assert sampling_from_proto(pb.SamplingParams(max_tokens=5), True).repetition_penalty == 1.0


# -- on the tiny preset -------------------------------------------------------------


def test_penalties_change_what_the_engine_generates():
    plain = make_engine().generate([PROMPT], greedy())[0]
    penalized = make_engine().generate([PROMPT], greedy(frequency_penalty=2.0))[0]
    assert penalized != plain
    # A strong frequency penalty spreads the output over more distinct tokens.
    assert len(set(penalized)) > len(set(plain))
    banned = make_engine().generate([PROMPT], greedy(logit_bias={plain[0]: -100.0}))[0]
    assert banned[0] != plain[0]


@pytest.mark.parametrize("controls", [
    dict(frequency_penalty=0.4),
    dict(frequency_penalty=1.5, presence_penalty=0.5),
    dict(repetition_penalty=1.8),
    dict(temperature=0.9, seed=77, frequency_penalty=1.0, repetition_penalty=1.3, min_p=0.05),
])
def test_penalized_stream_continues_on_another_engine(controls):
    """Cut after k tokens and re-prefilled as prompt + those k tokens with
    sample_offset=k, the stream penalizes them as generated, not as prompt."""
    params = dict(ignore_eos=True, **controls)
    whole = make_engine().generate([PROMPT], SamplingParams(max_tokens=24, **params))[0]
    k = 6
    rest = make_engine().generate([PROMPT + whole[:k]], SamplingParams(
        max_tokens=24 - k, sample_offset=k, **params))[0]
    assert whole[:k] + rest == whole
