"""Logprobs through the Coordinator: which leg is asked for what, a PD pair's first
token scored by P, and the OpenAI shapes (chat, completions, echo) built from them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pdserve.api.proto import engine_pb2 as pb
from pdserve.api.sampling import SamplingParams
from pdserve.coordinator.errors import ServeError
from pdserve.coordinator.legs import DecodeLeg, LegFailure, PairedLegs, PrefillLeg
from pdserve.coordinator.lifecycle import engine_request
from pdserve.coordinator.logprobs import OutputLogprobs, TokenTexts
from pdserve.coordinator.metrics import CoordinatorMetrics
from pdserve.coordinator.schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ResponseBuilder,
    build_usage,
)
from pdserve.coordinator.serving import build_generation_params
from pdserve.coordinator.settings import CoordinatorSettings
from pdserve.coordinator.timings import RequestTimings
from pdserve.runtime.tokenizer import ByteTokenizer
from tests.unit.coordinator.harness import inst, serve
from tests.unit.coordinator.test_legs import Aborts, ScriptedClient, call_of

PROMPT = [72, 105, 33]  # "Hi!"
TEXTS = TokenTexts(ByteTokenizer(320))


def entry(token_id: int, logprob: float, *top: tuple[int, float]) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=token_id, logprob=logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in top])


def test_prompt_logprobs_are_asked_of_the_leg_that_prefills_on_a_first_attempt():
    params = SamplingParams(max_tokens=8, logprobs=True, top_logprobs=3, prompt_logprobs=True)
    prefill = pb.KVTransferParams(role="prefill", mode="push", transfer_id="x", peer="d:2")
    decode = pb.KVTransferParams(role="decode", mode="push", transfer_id="x", peer="p:2")
    for kv, num_generated, expected in ((None, 0, True), (prefill, 0, True), (decode, 0, False),
                                        (None, 2, False), (prefill, 2, False)):
        sampling = engine_request(params, "r", PROMPT, num_generated, kv).sampling
        assert (sampling.logprobs, sampling.top_logprobs) == (True, 3)
        assert sampling.prompt_logprobs is expected, (kv and kv.role, num_generated)


def test_request_fields_become_generation_params():
    settings = CoordinatorSettings()
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    p = build_generation_params(ChatCompletionRequest(**chat, logprobs=True, top_logprobs=4), settings)
    assert (p.logprobs, p.top_logprobs, p.prompt_logprobs) == (True, 4, False)
    with pytest.raises(ServeError) as info:
        build_generation_params(ChatCompletionRequest(**chat, top_logprobs=2), settings)
    assert info.value.param == "top_logprobs"
    completion = {"model": "tiny", "prompt": "hi"}
    p = build_generation_params(CompletionRequest(**completion, logprobs=0, echo=True), settings)
    assert (p.logprobs, p.top_logprobs, p.prompt_logprobs) == (True, 0, True)
    p = build_generation_params(CompletionRequest(**completion, echo=True), settings)
    assert (p.logprobs, p.prompt_logprobs) == (False, False)  # echo alone: text only


def make_pair(params: SamplingParams):
    aborts, timings = Aborts(), RequestTimings("r1", CoordinatorMetrics())
    legs = []
    for kind, engine, role in ((PrefillLeg, inst("p1", "prefill"), "prefill"),
                               (DecodeLeg, inst("d1", "decode"), "decode")):
        kv = pb.KVTransferParams(role=role, mode="push", transfer_id="x-r1", peer="peer:2")
        legs.append(kind(engine, engine_request(params, "r1", PROMPT, 0, kv), ScriptedClient(),
                         timings, aborts))
    return PairedLegs(*legs)


def test_pair_waits_for_p_to_score_the_first_token_before_yielding_it():
    async def scenario():
        pair = make_pair(SamplingParams(max_tokens=3, logprobs=True, top_logprobs=1,
                                          prompt_logprobs=True))
        pair.start(10.0)
        # D's first token (P's, exposed on D) arrives before P's message of it.
        call_of(pair.decode).send(token_ids=[65], timings=pb.Timings(kv_wait_s=0.1))
        call_of(pair.decode).send(token_ids=[66], logprobs=[entry(66, -0.5, (66, -0.5))])
        stream = pair.tokens()
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        assert not first.done()  # waiting for P's logprob of it
        call_of(pair.prefill).send(token_ids=[65], logprobs=[entry(65, -0.25, (65, -0.25))],
                                   prompt_logprobs=[entry(105, -3.0), entry(33, -2.0)])
        assert await asyncio.wait_for(first, 5) == [65]
        assert [e.token_id for e in pair.take_logprobs()] == [65]
        assert [e.logprob for e in pair.prompt_logprobs] == [-3.0, -2.0]
        assert await stream.__anext__() == [66]
        assert [e.logprob for e in pair.take_logprobs()] == [-0.5]
        call_of(pair.prefill).send(finished=True, finish_reason="handoff")
        pair.close()

    asyncio.run(scenario())


def test_p_ending_without_its_first_token_fails_the_attempt():
    async def scenario():
        pair = make_pair(SamplingParams(max_tokens=3, logprobs=True))
        pair.start(10.0)
        call_of(pair.decode).send(token_ids=[65])
        call_of(pair.prefill).send(finished=True, finish_reason="handoff")
        with pytest.raises(LegFailure) as info:
            async for _ in pair.tokens():
                pass
        pair.close()
        assert (info.value.leg, info.value.stage, info.value.reason) == (
            "prefill", "before_handoff", "no_first_token")

    asyncio.run(scenario())


def test_a_pair_without_logprobs_does_not_wait_for_p():
    async def scenario():
        pair = make_pair(SamplingParams(max_tokens=1))
        pair.start(10.0)
        call_of(pair.decode).send(token_ids=[65], finished=True, finish_reason="length")
        assert [ids async for ids in pair.tokens()] == [[65]]  # P has sent nothing
        assert pair.take_logprobs() == []
        pair.close()

    asyncio.run(scenario())


def run_with(logprobs: list[pb.TokenLogprob], prompt_logprobs=None):
    """What ``OutputLogprobs`` reads of a ``RequestRun``."""
    return SimpleNamespace(prompt_ids=PROMPT, logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def test_chat_logprobs_are_openai_chat_logprobs():
    run = run_with([entry(65, -0.1, (65, -0.1), (66, -2.5)), entry(0xC3, -1.0, (0xC3, -1.0))])
    out = OutputLogprobs(run, TEXTS, is_chat=True, num_top=2)
    logprobs = out.take()
    assert logprobs["content"][0] == {
        "token": "A", "logprob": pytest.approx(-0.1), "bytes": [65],
        "top_logprobs": [{"token": "A", "logprob": pytest.approx(-0.1), "bytes": [65]},
                         {"token": "B", "logprob": -2.5, "bytes": [66]}]}
    assert logprobs["content"][1]["token"] == "\ufffd"  # half a character, decoded alone
    assert out.take() == {"content": []}  # nothing new
    shape = ResponseBuilder("cmpl-1", "tiny", 1700000000, is_chat=True)
    body = shape.response("A\ufffd", "length", build_usage(3, 2), logprobs=logprobs)
    ChatCompletion.model_validate(body)
    assert ChatCompletionResponse.model_validate(body).model_dump(exclude_unset=True) == body
    run.logprobs.append(entry(66, -0.7))
    ChatCompletionChunk.model_validate(shape.chunk("B", logprobs=out.take()))


def test_completion_logprobs_with_echo_put_the_prompt_first():
    run = run_with([entry(65, -0.1, (66, -0.05), (65, -0.1)), entry(67, -4.0, (68, -0.3))],
                   prompt_logprobs=[entry(105, -3.0, (105, -3.0)), entry(33, -2.0, (34, -1.0))])
    out = OutputLogprobs(run, TEXTS, is_chat=False, num_top=1, echo_text="Hi!")
    logprobs = out.take()
    assert logprobs == {
        "tokens": ["H", "i", "!", "A", "C"],
        "token_logprobs": [None, -3.0, -2.0, pytest.approx(-0.1), -4.0],
        # the likeliest alternative, and the token itself where it is not the likeliest
        "top_logprobs": [None, {"i": -3.0}, {'"': -1.0, "!": -2.0},
                         {"B": pytest.approx(-0.05), "A": pytest.approx(-0.1)},
                         {"D": pytest.approx(-0.3), "C": -4.0}],
        "text_offset": [0, 1, 2, 3, 4],
    }
    shape = ResponseBuilder("cmpl-1", "tiny", 1700000000, is_chat=False)
    body = shape.response("Hi!AC", "length", build_usage(3, 2), logprobs=logprobs)
    assert CompletionResponse.model_validate(body).model_dump(exclude_unset=True) == body
    run.logprobs.append(entry(69, -0.2))
    more = out.take()  # a stream's next chunk: offsets go on after what was sent
    assert (more["tokens"], more["text_offset"]) == (["E"], [5])
    no_echo = OutputLogprobs(run, TEXTS, is_chat=False, num_top=0).take()
    assert no_echo["text_offset"] == [0, 1, 2] and no_echo["top_logprobs"][0] == {"A": pytest.approx(-0.1)}
    Completion.model_validate(shape.response("ACE", "length", build_usage(3, 3), logprobs=no_echo))


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_that_sends_no_prompt_logprobs_is_a_502_not_a_crash(loop, stubs, stream):
    body = {"model": "tiny", "prompt": "hi there", "max_tokens": 2, "logprobs": 1, "echo": True,
            "stream": stream}
    with serve(loop, [stubs(num_tokens=2)]) as app:  # the stub computes no logprobs
        r = httpx.post(app.url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 502, r.text
    assert "sent 0 prompt logprobs for 8 prompt tokens" in r.json()["error"]["message"]
