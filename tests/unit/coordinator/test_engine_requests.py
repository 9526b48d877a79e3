"""The one carrier of sampling settings (``api/sampling.SamplingParams``) across the
Coordinator/engine boundary: its fields are the wire message's, name for name; what a
leg's request carries is what the engine reads back (``from_proto``), for every kind
of leg, first attempts and continuations, with and without the optional fields; a PD
attempt's prefill request, made from its decode request, leaves that one as it was."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.api.proto import engine_pb2 as pb
from pdserve.api.sampling import WIRE_ZERO_IS_DEFAULT, SamplingParams
from pdserve.coordinator.lifecycle import engine_request, paired_requests

PROMPT = list(range(40)) + [2**31 - 1, 0]
NOT_SAMPLING = {"n"}  # the wire's; the engine refuses n > 1 (choices fork in the Coordinator)

# Floats exact in float32, the wire's width.
PARAMS = [
    SamplingParams(max_tokens=16),
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=-0.0, top_p=1.0, seed=0, min_tokens=5),
    SamplingParams(max_tokens=30, temperature=0.75, top_p=0.5, seed=7, stop=["\n", "END"],
                   min_tokens=3, top_k=40, min_p=0.25, presence_penalty=0.5,
                   frequency_penalty=-0.25, repetition_penalty=1.5, logit_bias={5: -100.0},
                   stop_token_ids=[2, 3], logprobs=True, top_logprobs=4, prompt_logprobs=True,
                   guided=("json_schema", '{"type": "object"}')),
]


def test_the_carrier_and_the_wire_have_the_same_fields():
    carrier = {f.name for f in dataclasses.fields(SamplingParams)}
    wire = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields}
    assert carrier == wire - NOT_SAMPLING


@pytest.mark.parametrize("params", PARAMS)
def test_the_wire_gives_back_what_was_sent(params):
    assert SamplingParams.from_proto(params.to_proto()) == params


def test_the_wire_zeros_of_another_producer_are_the_defaults():
    read = SamplingParams.from_proto(pb.SamplingParams())
    defaults = SamplingParams()
    assert read == defaults
    assert all(getattr(read, name) == getattr(defaults, name) != 0 for name in WIRE_ZERO_IS_DEFAULT)


def kv(role: str) -> pb.KVTransferParams:
    return pb.KVTransferParams(role=role, mode="layerwise", transfer_id="x-r1", peer="10.0.0.1:2")


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("num_generated", [0, 1, 4])
def test_each_leg_asks_for_what_is_left_of_the_stream(params, num_generated):
    prompt = PROMPT + [7] * num_generated

    def expected(prefills: bool) -> SamplingParams:
        return dataclasses.replace(
            params, max_tokens=params.max_tokens - num_generated, sample_offset=num_generated,
            min_tokens=max(0, params.min_tokens - num_generated),
            prompt_logprobs=params.prompt_logprobs and prefills and num_generated == 0)

    for kv_transfer in (None, kv("prefill"), kv("decode")):
        request = engine_request(params, "r1", prompt, num_generated, kv_transfer)
        prefills = kv_transfer is None or kv_transfer.role == "prefill"
        assert SamplingParams.from_proto(request.sampling) == expected(prefills)
        assert list(request.prompt_token_ids) == prompt and request.request_id == "r1"
        assert request.HasField("kv_transfer") == (kv_transfer is not None)
    decode, prefill = paired_requests(params, "r1.2", prompt, num_generated, kv("decode"),
                                      kv("prefill"))
    alone = engine_request(params, "r1.2", prompt, num_generated, kv("decode"))
    assert decode.SerializeToString() == alone.SerializeToString()  # after P's was made from it
    assert SamplingParams.from_proto(prefill.sampling) == expected(True)
    assert list(prefill.prompt_token_ids) == prompt and prefill.kv_transfer == kv("prefill")
