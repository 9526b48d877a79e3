"""KV transfer between engines that split the KV heads differently: P at tensor parallel
size ``p`` feeding D at ``d`` (``p`` a multiple of ``d``, as the spec's rule allows, and
equal sizes), in every mode, over tcp and Mooncake for every pair and over shm and NIXL
for one. Each engine runs in its own process (``EngineProcess``) with its ranks as
real processes; the tiny preset has 2 KV heads, so at TP=4 each head is replicated on
two ranks and only one of them sends it.

For each pair and mode: greedy output equals one TP=1 hybrid engine's; D's KV of the
prompt equals byte for byte what a TP=p engine computes for it (the heads landed where
D's layout wants them) and matches a TP=d engine's within float tolerance (the ranks'
partial sums add up in another order); a second prompt over the first one's leading
blocks moves only the missing tokens (partial transfer), counted in bytes from D's
layout; and every block comes back.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.api.sampling import SamplingParams
from tests.unit.engine.pd_harness import (
    MODES,
    EngineProcess,
    run_until_idle,
    submit_pair,
    tokens,
)

KV_HEADS, HEAD_DIM, LAYERS, DTYPE_BYTES = 2, 32, 4, 4  # the tiny preset, float32
PAIRS = [(p, d, t) for p, d in ((2, 1), (2, 2), (4, 2), (4, 1)) for t in ("tcp", "mooncake")]
PAIRS += [(2, 1, "shm"), (2, 1, "nixl")]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _prompts(mode: str) -> tuple[list[int], list[int]]:
    """Two prompts per mode (none of them in any cache yet): the second starts with the
    first's four full blocks (block size 8)."""
    base = 1 + 70 * MODES.index(mode)
    first = list(range(base, base + 37))
    return first, first[:32] + [250 + i for i in range(9)]


def _bytes_per_token(d_tp: int) -> int:
    """What one token's KV costs D's layout: each D rank gets each head it holds, once."""
    held = max(KV_HEADS, d_tp)  # with fewer heads than ranks every rank holds one
    return LAYERS * 2 * held * HEAD_DIM * DTYPE_BYTES


def _run_alone(engine: EngineProcess, rid: str, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """(greedy tokens, the prompt's KV once prefilled) of a hybrid engine."""
    kv = {}

    def capture(_, out):
        if out.num_output_tokens == 1 and not out.finished:
            kv["kv"] = engine.full_kv(out.request_id)

    engine.add_request(rid, prompt, PARAMS)
    return tokens(run_until_idle(engine, on_outputs=capture)[rid]), kv["kv"]


@pytest.fixture(scope="module")
def references():
    """Hybrid engines at TP 1, 2 and 4 (a transport, so every rank's KV is readable), and
    what each computes for every prompt of the tests: (tokens, KV) by (tp, prompt)."""
    engines = {tp: EngineProcess("hybrid", "tcp", tensor_parallel_size=tp, num_threads=1)
               for tp in (1, 2, 4)}
    computed: dict[tuple[int, tuple[int, ...]], tuple[list[int], torch.Tensor]] = {}
    try:
        for tp, engine in engines.items():
            for mode in MODES:
                for i, prompt in enumerate(_prompts(mode)):
                    computed[tp, tuple(prompt)] = _run_alone(engine, f"ref-{mode}-{i}", prompt)
            engine.assert_all_free()
    finally:
        for engine in engines.values():
            engine.close()
    return computed


@pytest.fixture(scope="module", params=PAIRS, ids=lambda v: f"p{v[0]}-d{v[1]}-{v[2]}")
def pair(request):
    p_tp, d_tp, transport = request.param
    p = EngineProcess("prefill", transport, tensor_parallel_size=p_tp, num_threads=1)
    d = EngineProcess("decode", transport, tensor_parallel_size=d_tp, num_threads=1)
    yield p, d, p_tp, d_tp
    p.close()
    d.close()


@pytest.mark.parametrize("mode", MODES)
def test_kv_is_relaid_out_between_tensor_parallel_sizes(references, pair, mode):
    p, d, p_tp, d_tp = pair
    counter = d if mode == "pull" else p  # the side that moves the bytes counts them
    for i, prompt in enumerate(_prompts(mode)):
        rid = f"{mode}-{i}"
        exposed = {}

        def capture(engine, out, exposed=exposed):
            if engine is d and out.num_output_tokens == 1 and not out.finished:
                exposed["kv"] = d.full_kv(out.request_id)
                exposed["cached"] = out.num_cached_tokens

        before = counter.stats().kv_transfer_bytes
        submit_pair(p, d, rid, prompt, PARAMS, mode)
        outs = run_until_idle(p, d, on_outputs=capture)
        moved = counter.stats().kv_transfer_bytes - before

        cached = 32 if i == 1 else 0  # the second prompt's four leading blocks are on D
        assert exposed["cached"] == cached
        assert moved == (len(prompt) - cached) * _bytes_per_token(d_tp)
        expected, _ = references[1, tuple(prompt)]
        assert tokens(outs[f"d-{rid}"]) == expected
        assert torch.equal(exposed["kv"], references[p_tp, tuple(prompt)][1])
        torch.testing.assert_close(exposed["kv"], references[d_tp, tuple(prompt)][1],
                                   atol=1e-5, rtol=1e-5)
    p.assert_all_free()
    d.assert_all_free()
