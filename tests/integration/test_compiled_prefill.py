"""The engine's CPU fast paths against the plain ones, on the real model (SmolLM2 in
bfloat16, packed weights, one engine in this process): prefill steps with compiled
dense parts (``pdserve/engine/compiled.py``) against eager ones (the same greedy ids on
real prompts, prompt logprobs as close to float32's, one graph for every layer and size,
the KV hook fired per layer in order), decode attention read in place by the
native kernel (``pdserve/engine/native``) against gather and SDPA (the same ids), and
the linears through the native GEMM against oneDNN (the same ids)."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
from torch._dynamo.utils import counters

from pdserve.api.sampling import SamplingParams
from pdserve.engine import compiled, native
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model import after_attention, before_attention
from pdserve.engine.prepack import can_prepack
from tests.real_model import PRESET

pytestmark = pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.bfloat16),
                                reason="this CPU has no oneDNN bfloat16 matmuls")

PROMPTS = [
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light "
    "into chemical energy. In the chloroplasts, chlorophyll absorbs mostly blue and red light; "
    "the energy splits water, releasing oxygen, and drives the Calvin cycle, which fixes carbon "
    "dioxide into sugars. Some of that sugar is burned for energy right away; the rest is "
    "stored as starch or built into cellulose. Explain in two sentences why leaves look green.",
    "Here is a Python function:\n\ndef fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n\nWhat does fib(10) return, and how many additions "
    "does the loop make? Then rewrite the function so that it returns the whole list of the "
    "first n Fibonacci numbers instead of only the last one, keeping it iterative.",
    "The old lighthouse stood at the end of the harbour wall for two hundred years. Every "
    "night the keeper climbed its hundred and twelve steps, trimmed the wick and wound the "
    "clockwork that turned the lens. Ships from the north came in by its light through the "
    "narrow channel between the rocks, and the fishermen's children learned to count by its "
    "flashes: three short, one long. When the electric lamp came, the keeper stayed on to "
    "polish the brass and log the weather, though no one asked him to. One winter a storm "
    "broke the power line, and for three nights the harbour was dark, until the old man "
    "found the last can of oil in the cellar. Write the next paragraph of this story, in the "
    "same style, telling what happened on the fourth night.",
]
MAX_TOKENS = 16
# Two bfloat16 paths round differently; a greedy pick between tokens closer than this
# (in log probability) may go either way, and the continuations part there.
TIE = 0.2


@pytest.fixture(scope="module")
def engine():
    saved = os.environ.pop(compiled.SWITCH, None)
    try:
        engine = LLMEngine(EngineConfig(model=PRESET, dtype="bfloat16", num_threads=1, num_kv_blocks=256,
                                        enable_prefix_caching=False))
    finally:
        if saved is not None:
            os.environ[compiled.SWITCH] = saved
    yield engine
    engine.close()


@contextlib.contextmanager
def paths(engine: LLMEngine, compiled_prefill: bool = True, native_decode: bool = True,
          native_gemm: bool = True):
    """The engine with its compiled prefill, native decode and native GEMM on or off for a
    while."""
    runner, model = engine.runner, engine.runner.model
    kept = model.compiled, runner.decode_kernel
    gemms = {p: p.gemm for p in model.parameters() if hasattr(p, "gemm")}
    model.compiled = kept[0] if compiled_prefill else None
    runner.decode_kernel = kept[1] if native_decode else None
    for p in gemms if not native_gemm else ():
        del p.gemm
    try:
        yield
    finally:
        model.compiled, runner.decode_kernel = kept
        for p, gemm in gemms.items():
            p.gemm = gemm


def run(engine: LLMEngine, prompts: list[list[int]], tag: str, together: bool = False):
    """The prompts one at a time (each prefill one step), or ``together`` in one batch;
    each finished request with its sampled tokens' logprobs (top 2)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=True, logprobs=True,
                            top_logprobs=2)
    reqs, logprobs = [], {}
    for group in ([prompts] if together else [[p] for p in prompts]):
        for p in group:
            reqs.append(engine.add_request(f"{tag}-{len(reqs)}", p, params))
        while engine.has_unfinished:
            for out in engine.step():
                logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
    return [(r, logprobs[r.request_id]) for r in reqs]


def agree_where_decided(a, b) -> int:
    """The two greedy runs pick the same tokens until one is a near-tie (``TIE`` nats
    between the two likeliest in ``a``), after which they may part; the tokens compared."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.token_id != y.token_id:
            (_, first), (_, second) = x.top[:2]
            assert first - second < TIE, f"token {i}: {x.token_id} against {y.token_id}, margin {first - second:.3f}"
            return i
    return len(a)


def test_the_engine_compiles_prefill_at_start_and_decode_stays_eager(engine):
    model = engine.runner.model
    assert model.compiled is not None
    assert model.dense_parts(compiled.COMPILE_MIN_TOKENS) == (model.compiled.before, model.compiled.after)
    assert model.dense_parts(compiled.COMPILE_MIN_TOKENS - 1) == (before_attention, after_attention)
    assert model.dense_parts(8) == (before_attention, after_attention)


def test_compiled_prefill_gives_eager_greedy_ids_and_logprobs_as_close_to_float32(engine):
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    assert all(len(p) >= compiled.COMPILE_MIN_TOKENS for p in prompts), [len(p) for p in prompts]
    graphs = counters["stats"]["unique_graphs"]
    with paths(engine, compiled_prefill=False):
        eager = run(engine, prompts, "eager")
    comp = run(engine, prompts, "compiled")
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile for new sizes or layers
    exact = LLMEngine(EngineConfig(model=PRESET, dtype="float32", num_threads=1, num_kv_blocks=64,
                                   enable_prefix_caching=False))
    reference = run(exact, prompts, "f32")
    for (e, e_lps), (c, c_lps), (r, _) in zip(eager, comp, reference, strict=True):
        assert c_lps[0].token_id == e_lps[0].token_id  # the compiled prefill's own token
        print(f"{e.num_prompt_tokens} tokens: {agree_where_decided(e_lps, c_lps)} of {MAX_TOKENS} the same")
        # Both bfloat16 paths round; the compiled one (fused, summed in another order) is
        # to be no further from float32's prompt logprobs than eager is.
        err_eager, err_comp = error(e, r), error(c, r)
        print(f"  mean |logprob - float32's| eager {err_eager:.4f}, compiled {err_comp:.4f}, "
              f"between them {error(c, e):.4f}")
        assert err_comp < 1.25 * err_eager


def error(request, reference) -> float:
    """Mean absolute difference of two requests' prompt logprobs."""
    pairs = list(zip(request.prompt_logprobs, reference.prompt_logprobs, strict=True))
    assert len(pairs) == request.num_prompt_tokens - 1
    return sum(abs(a.logprob - b.logprob) for a, b in pairs) / len(pairs)


def test_native_decode_attention_gives_the_torch_paths_greedy_ids(engine):
    assert engine.runner.decode_kernel is not None
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    native = run(engine, prompts, "native", together=True)  # decode rows of three lengths
    with paths(engine, native_decode=False):
        plain = run(engine, prompts, "gather", together=True)
    compared = [agree_where_decided(p_lps, n_lps) for (_, p_lps), (_, n_lps) in zip(plain, native, strict=True)]
    print(f"tokens the same until a near-tie: {compared} of {MAX_TOKENS}")
    assert sum(compared) >= MAX_TOKENS  # not all parted at once


def test_linears_through_the_native_gemm_give_onednns_greedy_ids(engine, monkeypatch):
    model = engine.runner.model
    read_in_place = [p for p in model.parameters() if hasattr(p, "gemm")]
    if native.gemm_kernel() is None:
        assert not read_in_place  # a CPU without AVX-512 BF16: oneDNN for every linear
        return
    # Every projection of SmolLM2 and its head: their shapes are multiples of 64.
    assert len(read_in_place) == 4 * engine.model_config.num_hidden_layers + 1
    calls = []
    gemm = read_in_place[0].gemm
    for p in read_in_place:
        monkeypatch.setattr(p, "gemm", lambda x, w: calls.append(x.shape[0]) or gemm(x, w))
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    fast = run(engine, prompts, "gemm", together=True)  # decode steps of three rows
    # The prefill (one compiled step of every prompt) and the decode steps both take it.
    assert sum(map(len, prompts)) in calls and 3 in calls
    with paths(engine, native_gemm=False):
        assert not any(hasattr(p, "gemm") for p in model.parameters())
        plain = run(engine, prompts, "onednn", together=True)
    compared = [agree_where_decided(p_lps, f_lps) for (_, p_lps), (_, f_lps) in zip(plain, fast, strict=True)]
    print(f"tokens the same until a near-tie: {compared} of {MAX_TOKENS}")
    # oneDNN's sums in oneDNN's order, but one bfloat16 rounding in 10,000 outputs apart
    # from three rows up: the runs part only at a near-tie (agree_where_decided), and most
    # of them not at all.
    assert sorted(compared)[1:] == [MAX_TOKENS] * (len(PROMPTS) - 1)


def test_the_kv_hook_fires_for_every_layer_in_order_on_the_compiled_path(engine, monkeypatch):
    model, runner = engine.runner.model, engine.runner
    calls, fired = [], []
    before = model.compiled.before
    monkeypatch.setattr(model.compiled, "before", lambda *a: calls.append(1) or before(*a))
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda batch, kv_ready=None: execute(batch, fired.append))
    prompt = engine.tokenizer.encode(PROMPTS[0])
    engine.add_request("hook", prompt, SamplingParams(max_tokens=1))
    engine.step()
    layers = engine.model_config.num_hidden_layers
    assert fired == list(range(layers)) and len(calls) == layers


def test_a_float32_engine_or_the_switch_leaves_prefill_eager(monkeypatch):
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_kv_blocks=16))
    assert compiled.can_compile(engine.runner.model).startswith("dtype")
    assert engine.runner.model.compiled is None
    monkeypatch.setenv(compiled.SWITCH, "0")
    assert compiled.can_compile(engine.runner.model) == "PDSERVE_COMPILE=0"


def test_past_its_budget_the_engine_serves_eager_until_the_compile_is_done():
    engine = LLMEngine(EngineConfig(model=PRESET, dtype="bfloat16", num_threads=1, num_kv_blocks=64,
                                    enable_prefix_caching=False, compile_prefill=False))
    model = engine.runner.model
    assert model.compiled is None
    assert compiled.enable(model, budget_s=0) is False  # still compiling: eager meanwhile
    prompt = engine.tokenizer.encode(PROMPTS[0])
    assert engine.generate([prompt], SamplingParams(max_tokens=2))  # serves meanwhile
    deadline = time.monotonic() + 120
    while model.compiled is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert model.compiled is not None and model.dense_parts(len(prompt))[0] is model.compiled.before
    engine.close()
