"""The legs' requests are the messages the field-by-field construction makes, byte for
byte: for every kind of leg, first attempts and continuations, with and without the
optional sampling fields; a PD attempt's prefill request, made from its decode
request, leaves that one as it was."""

from __future__ import annotations

import pytest

from pdserve.api.proto import engine_pb2 as pb
from pdserve.coordinator.lifecycle import GenerationParams

PROMPT = list(range(40)) + [2**31 - 1, 0]


def field_by_field(params: GenerationParams, leg_id: str, prompt_ids: list[int],
                   num_generated: int,
                   kv_transfer: pb.KVTransferParams | None) -> pb.GenerateRequest:
    """Every field of the request set from ``params`` in one constructor call."""
    prefills = kv_transfer is None or kv_transfer.role == "prefill"
    return pb.GenerateRequest(
        request_id=leg_id, prompt_token_ids=prompt_ids, kv_transfer=kv_transfer,
        sampling=pb.SamplingParams(
            max_tokens=params.max_tokens - num_generated, temperature=params.temperature,
            top_p=params.top_p, seed=params.seed, stop=params.stop, ignore_eos=params.ignore_eos,
            sample_offset=num_generated, min_tokens=max(0, params.min_tokens - num_generated),
            top_k=params.top_k, min_p=params.min_p, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty, logit_bias=params.logit_bias,
            stop_token_ids=params.stop_token_ids,
            guided=pb.GuidedDecoding(kind=params.guided[0], spec=params.guided[1])
            if params.guided else None,
            logprobs=params.logprobs, top_logprobs=params.top_logprobs,
            prompt_logprobs=params.prompt_logprobs and prefills and num_generated == 0,
            repetition_penalty=0.0 if params.repetition_penalty == 1.0
            else params.repetition_penalty))


PARAMS = [
    GenerationParams(max_tokens=16),
    GenerationParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    GenerationParams(max_tokens=9, temperature=-0.0, top_p=0.0, seed=0, min_tokens=5),
    GenerationParams(max_tokens=30, temperature=0.7, top_p=0.9, seed=7, stop=["\n", "END"],
                     min_tokens=3, top_k=40, min_p=0.05, presence_penalty=0.5,
                     frequency_penalty=-0.25, repetition_penalty=1.2, logit_bias={5: -100.0},
                     stop_token_ids=[2, 3], logprobs=True, top_logprobs=4, prompt_logprobs=True,
                     guided=("json_schema", '{"type": "object"}')),
]


def kv(role: str) -> pb.KVTransferParams:
    return pb.KVTransferParams(role=role, mode="layerwise", transfer_id="x-r1", peer="10.0.0.1:2")


def wire(request: pb.GenerateRequest) -> tuple[bytes, bytes]:
    return request.SerializeToString(), request.SerializeToString(deterministic=True)


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("num_generated", [0, 1, 4])
def test_each_leg_request_is_the_field_by_field_message(params, num_generated):
    prompt = PROMPT + [7] * num_generated

    def expected(leg_id, kv_transfer):
        return wire(field_by_field(params, leg_id, prompt, num_generated, kv_transfer))

    for kv_transfer in (None, kv("prefill"), kv("decode")):
        request = params.engine_request("r1", prompt, num_generated, kv_transfer)
        assert wire(request) == expected("r1", kv_transfer)
    decode, prefill = params.paired_requests("r1.2", prompt, num_generated, kv("decode"),
                                             kv("prefill"))
    assert wire(decode) == expected("r1.2", kv("decode"))  # after the prefill one was made
    assert wire(prefill) == expected("r1.2", kv("prefill"))
