"""Sampling and stopping on the ``tiny`` preset, and the detokenizer on its own.

Seeded sampling draws token ``i`` from a stream seeded by ``(seed, i)``, so a request
samples the same tokens alone or in any batch. Stop conditions end a request with
``finish_reason`` "stop" or "length"; stop strings never reach the released text.
"""

from __future__ import annotations

import pytest

from pdserve.api.sampling import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.runtime.detokenizer import Detokenizer
from pdserve.runtime.tokenizer import ByteTokenizer

PROMPT = list(b"Sampling on the tiny preset")
OTHERS = [list(b"a"), list(b"another prompt of some length"), list(range(60, 110))]


def make_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", block_size=8, num_kv_blocks=128))


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    return engine.generate([prompt], params)[0]


def assert_no_leak(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert not engine.requests


def sampled(seed: int | None, **kw) -> SamplingParams:
    kw.setdefault("temperature", 1.0)
    return SamplingParams(max_tokens=24, seed=seed, ignore_eos=True, **kw)


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


# -- seeded sampling ------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_batch_independent():
    params = sampled(seed=11, top_p=0.95, top_k=50)
    alone = run(make_engine(), PROMPT, params)
    assert run(make_engine(), PROMPT, params) == alone

    engine = make_engine()
    batch_params = [sampled(seed=3), GREEDY, params, sampled(seed=99, temperature=0.7)]
    outputs = engine.generate(OTHERS[:2] + [PROMPT] + OTHERS[2:], batch_params)
    assert outputs[2] == alone
    assert_no_leak(engine)


def test_different_seeds_differ():
    engine = make_engine()
    a, b = engine.generate([PROMPT, PROMPT], [sampled(seed=1), sampled(seed=2)])
    assert a != b
    assert a != run(engine, PROMPT, GREEDY)
    assert_no_leak(engine)


@pytest.mark.parametrize("params", [sampled(seed=5, top_k=1), sampled(seed=5, top_p=1e-6)],
                         ids=["top_k=1", "tiny top_p"])
def test_degenerate_filters_equal_greedy(params):
    engine = make_engine()
    assert run(engine, PROMPT, params) == run(engine, PROMPT, GREEDY)
    assert_no_leak(engine)


def test_temperature_without_seed_still_samples():
    engine = make_engine()
    req = engine.add_request("r", PROMPT, sampled(seed=None, temperature=0.8))
    assert req.sampling_params.seed is not None  # a concrete seed is assigned on arrival
    while engine.has_unfinished:
        engine.step()
    assert len(req.output_token_ids) == 24
    assert all(0 <= t < engine.model_config.vocab_size for t in req.output_token_ids)
    assert req.finish_reason == "length"
    assert_no_leak(engine)


# -- stop conditions --------------------------------------------------------------


def finish(engine: LLMEngine, request_id: str, prompt, params: SamplingParams):
    """Run one request to the end; returns it and the text its outputs released."""
    req = engine.add_request(request_id, prompt, params)
    streamed = ""
    while engine.has_unfinished:
        for out in engine.step():
            streamed += out.new_text
    return req, streamed


def test_max_tokens_finishes_with_length():
    engine = make_engine()
    req, _ = finish(engine, "r", PROMPT, SamplingParams(max_tokens=7, ignore_eos=True))
    assert len(req.output_token_ids) == 7
    assert req.finish_reason == "length"
    assert_no_leak(engine)


def test_stop_token_id_ends_the_request():
    engine = make_engine()
    reference = run(engine, PROMPT, GREEDY)
    # The first output token that did not occur earlier in the output.
    index = next(i for i in range(3, len(reference)) if reference[i] not in reference[:i])
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[reference[index]])
    req, _ = finish(engine, "r", PROMPT, params)
    assert req.output_token_ids == reference[: index + 1]
    assert req.finish_reason == "stop"
    assert_no_leak(engine)


def test_stop_string_truncates_text_and_stops():
    engine = make_engine()
    tokenizer = engine.tokenizer
    reference = run(engine, PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    text = tokenizer.decode(reference)
    # A two-character stop string of plain characters that the greedy text contains.
    start = next(
        i for i in range(2, len(text) - 1)
        if "\ufffd" not in text[i : i + 2] and text.find(text[i : i + 2]) == i
    )
    stop = text[start : start + 2]

    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop])
    req, streamed = finish(engine, "r", PROMPT, params)
    assert req.finish_reason == "stop"
    assert req.output_text == text[:start]
    assert streamed == req.output_text
    assert stop not in req.output_text
    assert len(req.output_token_ids) < len(reference)
    assert req.output_token_ids == reference[: len(req.output_token_ids)]
    assert_no_leak(engine)


# -- the detokenizer alone ----------------------------------------------------------


def feed(detok: Detokenizer, data: bytes) -> list[tuple[str, bool]]:
    """Append ``data`` one byte-token at a time; the released text after each."""
    return [detok.append([byte]) for byte in data]


def test_detokenizer_holds_back_a_partial_stop_string():
    detok = Detokenizer(ByteTokenizer(320), stop=["STOP"])
    assert feed(detok, b"abST") == [("a", False), ("b", False), ("", False), ("", False)]
    # "STx" cannot become "STOP" any more: released.
    detok = Detokenizer(ByteTokenizer(320), stop=["STOP"])
    assert [t for t, _ in feed(detok, b"abSTx")] == ["a", "b", "", "", "STx"]
    # The whole stop string: the held prefix is dropped, the request stops.
    detok = Detokenizer(ByteTokenizer(320), stop=["STOP"])
    assert feed(detok, b"abSTOP")[-1] == ("", True)
    assert detok.flush() == ""
    # Finishing for another reason releases what was held.
    detok = Detokenizer(ByteTokenizer(320), stop=["STOP"])
    feed(detok, b"abST")
    assert detok.flush() == "ST"


def test_detokenizer_holds_back_incomplete_utf8():
    detok = Detokenizer(ByteTokenizer(320), stop=[])
    euro = "€".encode()  # three bytes
    assert feed(detok, b"x" + euro + b"y") == [
        ("x", False), ("", False), ("", False), ("€", False), ("y", False),
    ]
    # A stop string with a multi-byte character.
    detok = Detokenizer(ByteTokenizer(320), stop=["é!"])
    released = feed(detok, "aé!".encode())
    assert released[-1] == ("", True)
    assert "".join(t for t, _ in released) == "a"


def test_detokenizer_without_tokenizer_releases_nothing():
    detok = Detokenizer(None, stop=["x"])
    assert detok.append([1, 2, 3]) == ("", False)
    assert detok.flush() == ""


def test_seeded_stream_continues_on_another_engine_with_sample_offset():
    """A stream cut after k tokens and re-prefilled elsewhere (prompt + the k tokens,
    sample_offset=k) draws exactly the tokens the uncut stream would have drawn."""
    prompt = [5, 9, 200, 31, 7, 77, 140]
    params = dict(temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    whole = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=64)).generate(
        [prompt], SamplingParams(max_tokens=12, **params))[0]
    k = 5
    rest = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=64)).generate(
        [prompt + whole[:k]], SamplingParams(max_tokens=12 - k, sample_offset=k, **params))[0]
    assert whole[:k] + rest == whole
    assert len(set(whole)) > 3
