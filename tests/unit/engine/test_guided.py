"""Grammar-constrained decoding on the engine: a random model's output obeys the
constraint (JSON Schema, regex, choice), ends "stop" when the grammar is complete,
and a stream continued on another engine (or on D after P's first token) yields
exactly what one uninterrupted run does."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.api.sampling import SamplingParams
from pdserve.engine.admission import EngineInputError
from pdserve.engine.config import EngineConfig
from pdserve.engine.guided import Grammars
from pdserve.engine.llm_engine import LLMEngine
from pdserve.runtime.tokenizer import load_tokenizer
from tests.unit.engine.pd_harness import (
    assert_all_free,
    make_engine,
    run_until_idle,
    submit_pair,
    tokens,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPT = list(b"Describe a person as JSON: ")


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="tiny", num_kv_blocks=256, block_size=8))


def _run(engine, prompt, kind, spec, **sampling):
    params = SamplingParams(max_tokens=sampling.pop("max_tokens", 200), guided=(kind, spec),
                            **sampling)
    request = engine.add_request(f"g-{id(params)}", prompt, params)
    while engine.has_unfinished:
        engine.step()
    return request


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 7), (1.5, 99)])
def test_json_schema_output_validates_and_ends_when_the_grammar_does(engine, temperature, seed):
    request = _run(engine, PROMPT, "json_schema", json.dumps(SCHEMA),
                   temperature=temperature, seed=seed)
    text = engine.tokenizer.decode(request.output_token_ids)
    assert request.finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert request.output_token_ids[-1] not in engine.model_config.eos_token_ids  # no EOS needed


def test_json_object_is_an_object(engine):
    request = _run(engine, PROMPT, "json_object", "", max_tokens=400, temperature=0.8, seed=3)
    text = engine.tokenizer.decode(request.output_token_ids)
    if request.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert request.finish_reason == "length" and text.startswith("{")


def test_regex_and_choice(engine):
    request = _run(engine, PROMPT, "regex", r"[0-9]{3}-[a-z]{2,4}", temperature=1.0, seed=5)
    text = engine.tokenizer.decode(request.output_token_ids)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
    assert request.finish_reason == "stop"
    seen = set()
    for seed in range(6):
        request = _run(engine, PROMPT, "choice", json.dumps(["yes", "no", "maybe"]),
                       temperature=1.5, seed=seed)
        seen.add(engine.tokenizer.decode(request.output_token_ids))
        assert request.finish_reason == "stop"
    assert seen <= {"yes", "no", "maybe"} and seen


def test_an_unconstrained_request_in_the_same_batch_is_unaffected(engine):
    free = SamplingParams(max_tokens=12)
    alone = engine.generate([PROMPT], free)[0]
    guided = SamplingParams(max_tokens=40, guided=("regex", "[a-c]+"))
    both = engine.generate([PROMPT, PROMPT], [free, guided])
    assert both[0] == alone
    assert set(engine.tokenizer.decode(both[1])) <= set("abc")


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 11)])
def test_a_continuation_replays_the_generated_tokens_into_its_matcher(engine, temperature, seed):
    """What the Coordinator does after a mid-stream failure: the prompt plus the tokens
    streamed so far, with sample_offset, on a fresh engine."""
    spec = json.dumps(SCHEMA)
    whole = _run(engine, PROMPT, "json_schema", spec, temperature=temperature, seed=seed)
    expected = whole.output_token_ids
    cut = len(expected) // 2
    other = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=256, block_size=8))
    params = SamplingParams(max_tokens=200 - cut, temperature=temperature, seed=seed,
                            sample_offset=cut, guided=("json_schema", spec))
    rest = other.generate([PROMPT + expected[:cut]], params)[0]
    assert expected[:cut] + rest == expected
    assert_all_free(other)


def test_a_continuation_that_broke_the_grammar_is_refused(engine):
    params = SamplingParams(max_tokens=10, sample_offset=3, guided=("regex", "[0-9]+"))
    with pytest.raises(EngineInputError, match="does not match the constraint"):
        engine.add_request("broken", PROMPT + list(b"abc"), params)


@pytest.mark.parametrize("kind,spec,message", [
    ("json_schema", '{"type": "nonsense"}', "nonsense"),
    ("json_schema", "{not json", "json_schema"),
    ("regex", "a(b", "unclosed group"),
    ("choice", "[]", "non-empty"),
    ("grammar", "start: missing_rule", "missing_rule"),
    ("yaml", "x", "unknown constraint kind"),
])
def test_a_bad_constraint_is_refused_with_its_reason(engine, kind, spec, message):
    with pytest.raises(EngineInputError, match=message):
        engine.add_request(f"bad-{kind}", PROMPT, SamplingParams(guided=(kind, spec)))
    assert not engine.requests


def test_a_compiled_grammar_is_reused(engine):
    spec = json.dumps({"enum": ["left", "right"]})
    _run(engine, PROMPT, "json_schema", spec)
    compiled = engine.grammars._compiled[("json_schema", spec)]
    _run(engine, PROMPT, "json_schema", spec, temperature=1.0, seed=1)
    assert engine.grammars._compiled[("json_schema", spec)] is compiled


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_pd_continues_the_grammar_on_d_after_p_sampled_the_first_token(mode):
    """P samples the first token under the grammar; D's matcher takes it from P and
    goes on: the output equals one engine's, and validates."""
    spec = json.dumps(SCHEMA)
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=21, guided=("json_schema", spec))
    hybrid = make_engine("hybrid", "none")
    expected = hybrid.generate([PROMPT], params)[0]
    p, d = make_engine("prefill"), make_engine("decode")
    try:
        submit_pair(p, d, "r1", PROMPT, params, mode)
        outs = run_until_idle(p, d)
        assert tokens(outs["d-r1"]) == expected
        assert outs["d-r1"][-1].finish_reason == "stop"
        jsonschema.validate(json.loads(d.tokenizer.decode(expected)), SCHEMA)
        assert_all_free(p, d)
    finally:
        p.close()
        d.close()


def test_a_hugging_face_tokenizer_is_bridged(tmp_path):
    """A byte-level BPE tokenizer.json (as Llama 3's, Qwen's): the grammar works on its
    merged tokens, and ids past the tokenizer's (the model's padded vocabulary) are never
    allowed."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(['{"name": "Ann", "age": 31}', "hello world " * 20] * 10,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=["<|eos|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    hf = load_tokenizer(tmp_path)
    vocab = 512
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                               "age": {"type": "integer", "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    matcher = Grammars(hf, vocab, hf.eos_token_ids).start(
        "json_schema", json.dumps(schema), [])
    out, pick = [], random.Random(0)
    while not matcher.is_done and len(out) < 100:
        mask = matcher.bitmask()
        allowed = [t for t in range(vocab) if mask[t // 8] >> (t % 8) & 1]
        assert allowed and max(allowed) < tok.get_vocab_size()
        token = pick.choice(allowed)
        if token in hf.eos_token_ids:
            break
        matcher.advance(token)
        out.append(token)
    assert matcher.error is None
    assert any(len(tok.id_to_token(t)) > 1 for t in out)  # merged tokens, not bytes alone
    jsonschema.validate(json.loads(hf.decode(out)), schema)
