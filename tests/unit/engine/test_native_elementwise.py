"""The native elementwise kernels (``native.Elementwise``, ``elementwise.c``) against the
torch code they replace on eager steps, RMSNorm and the half rotation; which
tensors and steps take them; and a small model's logits and greedy ids with and without
them."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import native
from pdserve.engine.config import ModelConfig
from pdserve.engine.model import RMSNorm, Transformer, after_attention, before_attention, use_native
from pdserve.engine.rope import Rotary, rotate


@pytest.fixture(scope="module")
def kernels():
    got = native.elementwise_kernels()
    assert got is not None, "the native kernels did not build (cc on PATH?): see the log"
    return got


def bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def within_one_rounding(got: torch.Tensor, want: torch.Tensor, equal_at_least: float) -> None:
    """Both bfloat16: apart by at most one unit in the last place of the larger, and equal
    in at least ``equal_at_least`` of the elements."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    ulp = torch.maximum(got.float().abs(), want.float().abs()) * 2.0**-7
    assert ((got.float() - want.float()).abs() <= ulp + 1e-30).all()
    assert (got == want).float().mean() >= equal_at_least


@pytest.mark.parametrize("rows,n", [(1, 576), (3, 64), (32, 576), (130, 4096)])
def test_rms_norm_gives_torchs_norm(kernels, rows, n):
    norm = RMSNorm(n, 1e-5, torch.bfloat16, torch.device("cpu"))
    norm.weight.data.copy_(bf16(n, seed=n, scale=0.5) + 1)
    # Rows with a stride (a view into a wider tensor), as the residual stream's are not.
    x = bf16(rows, n + 8, seed=rows, scale=3.0)[:, 4:n + 4]
    want = norm(x)  # no kernels yet: torch's ops
    norm.native = kernels
    got = norm(x)
    # The squares summed in another order: within one rounding, nearly always equal.
    within_one_rounding(got, want, 0.99)


@pytest.mark.parametrize("rows,heads,dim", [(1, 12, 64), (7, 12, 64), (33, 20, 128)])
def test_rotate_gives_torchs_bits(kernels, rows, heads, dim):
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=heads * dim, intermediate_size=8,
                      num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096)
    rope = Rotary(cfg, torch.device("cpu")).at(torch.randint(0, 4096, (rows,)))
    # q and k of the fused qkv rows: a view whose rows are wider than its heads.
    qkv = bf16(rows, (heads + 4) * dim, seed=heads, scale=2.0)
    x = qkv[:, :heads * dim].view(rows, heads, dim)
    assert kernels.takes(x)
    assert torch.equal(kernels.rotate(*rope, x), rotate(*rope, x))


def test_only_bfloat16_rows_on_eager_steps_take_the_kernels(kernels):
    x = bf16(4, 64, seed=0)
    assert kernels.takes(x) and kernels.takes(x.view(4, 2, 32))
    assert not kernels.takes(x.float())
    assert not kernels.takes(x.t())  # columns, not rows
    assert not kernels.takes(x.view(4, 2, 32).transpose(0, 1))  # heads not side by side

    seen = []

    def traced(t):
        seen.append(kernels.takes(t))
        return t + 1

    torch.compile(traced, backend="eager", fullgraph=True)(x)
    assert seen == [False]  # a graph torch.compile traces keeps torch's ops


def test_a_model_gives_the_same_greedy_ids_with_the_kernels(kernels, monkeypatch):
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=640,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True)
    model = Transformer(cfg, torch.bfloat16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.data.copy_((torch.randn(p.shape, generator=gen) * 0.08).bfloat16())
    for norm in (m for m in model.modules() if isinstance(m, RMSNorm)):
        norm.weight.data.fill_(1.0)
    calls = []
    for name in ("rms_norm", "rotate"):
        fn = getattr(native.Elementwise, name)
        monkeypatch.setattr(native.Elementwise, name,
                            lambda self, *a, _fn=fn, _name=name: calls.append(_name) or _fn(self, *a))

    def dense(ids: torch.Tensor) -> torch.Tensor:
        """The logits of the layers' dense parts over ``ids``, attention standing in as
        q plus its kv head's v (no cache needed)."""
        h = F.embedding(ids, model.embed_tokens)
        rope = model.rotary.at(torch.arange(ids.shape[0]))
        for layer in model.layers:
            q, _, v = before_attention(layer, h, rope)
            h = after_attention(layer, h, q + v.repeat_interleave(q.shape[1] // v.shape[1], dim=1))
        return model.compute_logits(model.norm(h))

    ids = torch.randint(0, 512, (24,), generator=gen)
    with torch.inference_mode():
        want = dense(ids)
        assert calls == []
        use_native(model, kernels)
        got = dense(ids)
    assert calls.count("rms_norm") == 2 * 3 + 1 and calls.count("rotate") == 3
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_the_kernels_are_one_per_process_and_pickle_as_such(kernels):
    assert pickle.loads(pickle.dumps(kernels)) is kernels


def test_with_the_switch_there_are_no_kernels(monkeypatch):
    monkeypatch.setenv(native.SWITCH, "0")
    native.elementwise_kernels.cache_clear()
    try:
        assert native.elementwise_kernels() is None
    finally:
        native.elementwise_kernels.cache_clear()
