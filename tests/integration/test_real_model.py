"""A real model through the whole path: SmolLM2-135M-Instruct, judged against transformers.

Engines for the module: P (prefill) and D (decode) on the Hugging Face checkpoint
that transformers converted from the ``smollm2`` preset's GGUF file
(``tests/real_model.py``), and H (hybrid) on the preset itself (pdserve's own GGUF
loader), all float32. Each test builds its own Coordinator on them; one runs the
preset in process in bfloat16, with and without prepacked linears. The oracle is
transformers on the converted checkpoint: chat prompts (its ``chat_template.jinja``),
token counts, greedy token ids.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from pdserve.api.sampling import SamplingParams
from pdserve.coordinator.app import create_app
from pdserve.coordinator.settings import CoordinatorSettings
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.prepack import can_prepack
from tests.procs import PDSERVE, Proc
from tests.real_model import FRANCE, PRESET, Reference, gguf_path, hf_checkpoint
from tests.unit.coordinator.harness import ALWAYS_PD, AppServer

ENGINE_ARGS = ["--port", "0", "--kv-transport", "tcp", "--num-kv-blocks", "128", "--block-size", "16",
               "--dtype", "float32", "--threads", "1"]
MAX_TOKENS = 12
SYSTEM = [{"role": "system", "content": "Answer in one word."}, *FRANCE]


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


@pytest.fixture(scope="module")
def engines():
    models = {"P": ("prefill", str(hf_checkpoint())), "D": ("decode", str(hf_checkpoint())),
              "H": ("hybrid", PRESET)}
    gguf_path()  # installed before the engines start, not by each of them
    procs = {n: Proc([*PDSERVE, "engine", "--model", m, "--role", r, *ENGINE_ARGS])
             for n, (r, m) in models.items()}
    try:
        yield {n: p.wait_for(r"serving model .* on (\S+:\d+)", 240).group(1) for n, p in procs.items()}
    finally:
        for p in procs.values():
            p.stop()


def coordinator(loop, engines, names, model, **overrides) -> AppServer:
    settings = CoordinatorSettings(engines=tuple(engines[n] for n in names), model=model,
                                   served_model_name="smollm2", block_size=16, poll_interval_s=0.2,
                                   **{**ALWAYS_PD, **overrides})
    return AppServer(loop, create_app(settings))


def greedy_chat(client: openai.OpenAI, messages, stream: bool) -> tuple[str, list[int]]:
    kwargs = dict(model="smollm2", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"return_token_ids": True})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.model_extra["token_ids"]
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    return text, [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]


def without_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


@pytest.mark.parametrize("mode", ["pull", "push", "layerwise"])
def test_pd_chat_names_paris_with_transformers_greedy_ids(engines, loop, reference, mode):
    want = reference.greedy(reference.chat_ids(FRANCE), MAX_TOKENS)
    eos = reference.tokenizer.eos_token_id
    with coordinator(loop, engines, ["P", "D"], str(hf_checkpoint()), kv_mode=mode) as app:
        client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
        for stream in (False, True):
            text, ids = greedy_chat(client, FRANCE, stream)
            assert "Paris" in text, (mode, stream, text)
            assert without_eos(ids, eos) == without_eos(want, eos), (mode, stream)
            assert text == reference.tokenizer.decode(without_eos(want, eos), skip_special_tokens=True)


@pytest.mark.parametrize("model", ["checkpoint", "preset", "gguf"])
def test_chat_prompts_count_as_transformers_renders_them(engines, loop, reference, model):
    # The checkpoint keeps its template in chat_template.jinja, the preset and the GGUF
    # file in the file's metadata: all three must give transformers' prompt.
    location = {"checkpoint": str(hf_checkpoint()), "preset": PRESET, "gguf": str(gguf_path())}[model]
    with coordinator(loop, engines, ["H"], location) as app:
        for messages in (FRANCE, SYSTEM):
            got = httpx.post(app.url + "/tokenize", json={"model": "smollm2", "messages": messages},
                             timeout=30).json()
            assert got["tokens"] == reference.chat_ids(messages), (model, messages)
            assert got["max_model_len"] == 8192
        models = httpx.get(app.url + "/v1/models", timeout=10).json()["data"][0]
        assert models["max_model_len"] == 8192 and models["dtype"] == "float32"  # auto: the file's
        source = httpx.get(app.url + "/ready?verbose=1", timeout=10).json()["chat_template"]
        assert source == ("chat_template.jinja" if model == "checkpoint"
                          else "SmolLM2-135M-Instruct.Q4_1.gguf (tokenizer.chat_template)")


def test_the_preset_gguf_engine_answers_as_transformers_on_the_same_file(engines, loop, reference):
    # H loaded the GGUF file itself (pdserve's loader); transformers' reference is its
    # own dequantization of the same file: the greedy ids must agree.
    want = reference.greedy(reference.chat_ids(SYSTEM), MAX_TOKENS)
    eos = reference.tokenizer.eos_token_id
    with coordinator(loop, engines, ["H"], PRESET) as app:
        client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
        for stream in (False, True):
            text, ids = greedy_chat(client, SYSTEM, stream)
            assert without_eos(ids, eos) == without_eos(want, eos), stream
            assert "Paris" in text
        done = client.completions.create(model="smollm2", prompt="The capital of France is",
                                         max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"return_token_ids": True})
        prompt_ids = reference.tokenizer("The capital of France is")["input_ids"]
        assert done.choices[0].model_extra["token_ids"] == reference.greedy(prompt_ids, MAX_TOKENS)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_required_tool_call_ends_with_the_calls_the_model_makes(engines, loop):
    # The model writes a newline after its call, then its end token; the arguments
    # hold only the keys the function declares (the schema leaves additionalProperties
    # unsaid), and a stream sends no chunk while a call's text is held back.
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    with coordinator(loop, engines, ["H"], PRESET) as app:
        client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
        kwargs = dict(model="smollm2", messages=ask, tools=[WEATHER], tool_choice="required",
                      max_tokens=120, temperature=0, parallel_tool_calls=False)
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert len(calls) == 1 and not choice.message.content, choice
        assert calls[0].function.name == "get_weather"
        assert set(json.loads(calls[0].function.arguments)) == {"city"}
        chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
        streamed = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
        assert [(t.function.name, t.function.arguments) for t in streamed] == [
            (c.function.name, c.function.arguments) for c in calls]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        empty = [c for c in chunks if not c.choices[0].finish_reason
                 and c.choices[0].delta.model_dump(exclude_none=True) in ({}, {"content": ""})]
        assert not empty, f"{len(empty)} chunks without content, call or finish"


@pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.bfloat16),
                    reason="this CPU has no oneDNN bfloat16 matmuls")
def test_bfloat16_prepacked_weights_answer_as_the_plain_ones(reference):
    # The packed linears (the default in bfloat16 on such a CPU; tied head kept plain)
    # against plain F.linear in one process, on the preset's own weights.
    prompt = reference.chat_ids(FRANCE)
    answers = {}
    for prepack in (True, False):
        engine = LLMEngine(EngineConfig(model=PRESET, dtype="bfloat16", num_threads=1, num_kv_blocks=16,
                                        prepack_weights=prepack))
        assert sum(p.is_mkldnn for p in engine.runner.model.parameters()) == (
            4 * engine.model_config.num_hidden_layers + 1 if prepack else 0)  # + the tied head's copy
        answers[prepack] = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS))[0]
    assert answers[True] == answers[False]
    assert "Paris" in reference.tokenizer.decode(answers[True])


def test_a_bfloat16_engine_process_compiles_its_prefill_and_answers(loop, reference):
    # What `pdserve engine --dtype bfloat16` runs by default: decode attention read in
    # place by the native kernel (engine/native) and, on a CPU with oneDNN bfloat16
    # matmuls (packed weights), prefill steps of 64 tokens or more compiled
    # (engine/compiled.py), as a process a user starts.
    proc = Proc([*PDSERVE, "engine", "--model", PRESET, "--role", "hybrid",
                 *[a if a != "float32" else "bfloat16" for a in ENGINE_ARGS]])
    try:
        address = proc.wait_for(r"serving model .* on (\S+:\d+)", 240).group(1)
        if can_prepack(torch.device("cpu"), torch.bfloat16):
            assert "prefill compiled for steps of >= 64 tokens" in proc.output
            assert "bfloat16 on this CPU has no native matmuls" not in proc.output
        else:
            assert "prefill not compiled: weights not packed" in proc.output
            assert "bfloat16 on this CPU has no native matmuls" in proc.output  # the user is told
        assert "native decode attention unavailable" not in proc.output
        messages = [{"role": "system", "content": "You are a geography teacher. " * 8 + "Answer in one word."},
                    *FRANCE]
        assert len(reference.chat_ids(messages)) >= 64  # a compiled prefill step
        with coordinator(loop, {"B": address}, ["B"], PRESET) as app:
            client = openai.OpenAI(base_url=app.url + "/v1", api_key="unused", max_retries=0)
            for stream in (False, True):
                text, ids = greedy_chat(client, messages, stream)
                assert "Paris" in text, (stream, text)
                assert len(ids) >= 2
    finally:
        proc.stop()
    assert "Traceback" not in proc.output
