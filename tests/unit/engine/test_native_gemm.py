"""The native GEMM of a few rows over oneDNN's packed weights (``native.PackedGemm``,
``packed_gemm.c``) against oneDNN and float64; the load-time check of the packed layout
(``prepack.gemm_layout_matches``); and which calls of ``prepack.linear`` take it."""

from __future__ import annotations

import pickle

import pytest
import torch

from pdserve.engine import native, prepack
from pdserve.engine.config import ModelConfig
from pdserve.engine.model import Transformer

pytestmark = pytest.mark.skipif(
    not prepack.can_prepack(torch.device("cpu"), torch.bfloat16) or native.gemm_kernel() is None,
    reason="this CPU has no AVX-512 BF16 (oneDNN keeps every linear)")

# SmolLM2's projections and head (N x K), and a wider K.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (128, 4096)]


def weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    plain = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16()
    return plain, torch.ops.mkldnn._reorder_linear_weight(plain)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 64])
def test_the_gemm_gives_onednns_products(n, k, rows):
    plain, packed = weights(n, k, seed=n + k)
    assert prepack.gemm_layout_matches(plain, packed)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = native.gemm_kernel()(x, packed)
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    exact = x.double() @ plain.double().T
    # Float32 sums over k in order, rounded once to bfloat16: as close to the exact
    # product as oneDNN's, and equal to it nearly everywhere.
    assert got.shape == onednn.shape == (rows, n) and got.dtype == torch.bfloat16
    ulp = exact.abs().clamp_min(1e-3) * 2**-7
    assert ((got.double() - exact).abs() <= ulp).all()
    assert (got == onednn).float().mean() > 0.99


def test_rows_with_a_stride_and_several_threads_sharing_rows_and_blocks():
    plain, packed = weights(3072, 576, seed=1)
    wide = torch.randn(130, 1000).bfloat16()  # three chunks of rows, the last of two
    x = wide[:, 100:676]  # rows 1,000 elements apart
    want = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(native.gemm_kernel()(x, packed), native.gemm_kernel()(x.contiguous(), packed))
        assert (native.gemm_kernel()(x, packed) == want).float().mean() > 0.99
    finally:
        torch.set_num_threads(threads)


def test_the_layout_check_refuses_what_the_kernel_cannot_read():
    plain, packed = weights(960, 576, seed=2)
    other, other_packed = weights(960, 576, seed=3)
    assert prepack.gemm_layout_matches(plain, packed)
    assert not prepack.gemm_layout_matches(other, packed)  # the bytes of another weight
    assert not prepack.gemm_layout_matches(plain.view(torch.float16), packed)
    odd, odd_packed = weights(100, 576, seed=4)  # not a multiple of 64 columns
    assert not prepack.gemm_layout_matches(odd, odd_packed)


def test_linear_takes_the_gemm_for_checked_weights_without_a_bias():
    plain, packed = weights(576, 576, seed=5)
    weight = torch.nn.Parameter(packed, requires_grad=False)
    rows_seen = []
    kernel = native.gemm_kernel()
    few, many = torch.randn(3, 576).bfloat16(), torch.randn(300, 576).bfloat16()
    onednn = {len(x): torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "") for x in (few, many)}
    assert torch.equal(prepack.linear(few, weight), onednn[3])  # not checked: oneDNN
    assert rows_seen == []
    weight.gemm = lambda x, w: rows_seen.append(len(x)) or kernel(x, w)
    for x in (few, many):
        assert (prepack.linear(x, weight) == onednn[len(x)]).float().mean() > 0.99
    bias = torch.randn(576).bfloat16()
    want = torch.ops.mkldnn._linear_pointwise(few, packed, bias, "none", [], "")
    assert torch.equal(prepack.linear(few, weight, bias), want)  # a bias: oneDNN adds it
    assert rows_seen == [3, 300]


def test_prepack_marks_the_weights_whose_layout_it_checked():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=128, intermediate_size=300,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=True)
    model = Transformer(cfg, torch.bfloat16, torch.device("cpu"))
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    assert prepack.prepack_linears(model) == 4 * 2 + 1
    read = {name for name, p in model.named_parameters() if hasattr(p, "gemm")}
    # qkv (256 x 128), o (128 x 128) and the tied head (256 x 128) lie as the kernel reads;
    # oneDNN pads gate_up's 600 rows and down's 300 columns, so those stay with it.
    assert read == {f"layers.{i}.self_attn.{name}" for i in range(2) for name in ("qkv_weight", "o_weight")
                    } | {"lm_head"}
    assert not hasattr(model.embed_tokens, "gemm")  # the plain embedding, for its lookups
    hidden = torch.randn(3, 128).bfloat16()
    logits = model.compute_logits(hidden)
    assert logits.shape == (3, 256)
    exact = hidden.double() @ model.embed_tokens.double().T
    assert (logits.double() - exact).abs().max() < 0.05


def test_the_kernel_is_one_per_process_and_pickles_as_such():
    kernel = native.gemm_kernel()
    assert pickle.loads(pickle.dumps(kernel)) is kernel
