"""Linear weights prepacked for oneDNN on CPU, and the one ``linear`` the model calls.

On a CPU with bfloat16 matmul support (AVX-512 BF16, AMX), ``F.linear`` on a plain
bfloat16 weight leaves oneDNN to block the weight for its kernel inside every call; a
weight reordered once at load (``torch.ops.mkldnn._reorder_linear_weight``, the
packing inductor's freezing uses) skips that, and a decode step spends most of its
time in these matmuls (figures in docs/benchmarks.md, "Engine throughput").

``prepack_linears`` replaces each linear weight parameter of a loaded model by its
packed form: the plain weight is dropped, so the model holds one copy. The embedding
stays plain (it is gathered by token id); a tied lm_head, which is the embedding, gets a
packed copy of its own (``Transformer.lm_head``): the one weight held twice, because the
head multiplies by the whole vocabulary every step (a plain 49,152-row head took 16% of
a SmolLM2 batch-8 step, about twice the packed one). Packing happens only where ``can_prepack`` says so: CPU, bfloat16, oneDNN
with bfloat16 support; float32 packed is slower at batch 1, and CUDA and NPU have
their own matmul libraries. A packed weight is opaque (``is_mkldnn``): it cannot be
sliced or copied into, so packing comes after every weight is loaded, on each
tensor-parallel rank after its shard is.

Where it runs (AVX-512 BF16), the packed weights are multiplied by ``native.PackedGemm``
instead, which reads oneDNN's packed buffer in place at nearly the memory's speed with a
few rows (decode steps: oneDNN reads it at two thirds of that with one row), and is
3-12% ahead with hundreds (prefill): only weights whose packed bytes
``gemm_layout_matches`` confirmed, at load, to lie as that kernel reads them
(``weight.gemm`` is then the kernel), and without a bias. The sums run in oneDNN's
order; the outputs were oneDNN's bit for bit at 1 and 2 rows, within one bfloat16
rounding where not.

Invariant: ``linear(x, w, b)`` gives what ``F.linear(x, w, b)`` gives on the plain
weight, whichever form ``w`` has: through oneDNN bit for bit in every SmolLM2 shape, 1 to
1,600 rows, torch 2.13; through the native GEMM within one bfloat16 rounding of it (the
tests hold the greedy ids equal).
"""

from __future__ import annotations

import ctypes
import logging

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.native import gemm_kernel

log = logging.getLogger(__name__)

# The parameters of each layer that only ever meet ``linear`` (model.py).
LINEAR_WEIGHTS = {"self_attn": ("qkv_weight", "o_weight"), "mlp": ("gate_up_weight", "down_weight")}


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` for a plain or a packed ``weight``; called by the model's
    layers for every projection and the lm_head. ``packed``: the owner's weights were
    packed (``prepack_linears`` marks the module): a weight traced by ``torch.compile``
    (a fake tensor) no longer shows ``is_mkldnn``, so the flag sends it to the packed call,
    opaque to the compiler (``packed_linear``). Not ``torch.compiler.is_compiling()``: a
    compile in another thread (``compiled.enable``) sets that for this one too."""
    if weight.is_mkldnn:
        return multiply_packed(x, weight, bias)
    if packed:
        return packed_linear(x, weight, bias)
    return F.linear(x, weight, bias)


@torch.library.custom_op("pdserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return multiply_packed(x, weight, bias)


def multiply_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a packed ``weight``: the native GEMM where the weight's
    layout was checked for it (``weight.gemm``), else oneDNN."""
    gemm = getattr(weight, "gemm", None)
    if gemm is not None and bias is None and x.dim() == 2 and x.stride(1) == 1:
        out = gemm(x, weight)
        if out is not None:
            return out
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def prepack_linears(model: nn.Module) -> int:
    """Replace ``model``'s linear weights by oneDNN-packed ones, if ``can_prepack``; called
    once by ``loader.load_model`` after the weights are in. Returns the number packed."""
    device, dtype = model.embed_tokens.device, model.embed_tokens.dtype
    if not can_prepack(device, dtype):
        if device.type == "cpu" and dtype == torch.bfloat16:
            log.warning("bfloat16 on this CPU has no native matmuls (oneDNN reports no bfloat16 "
                        "support: no AVX-512 BF16 or AMX), so they are emulated: expect about half "
                        "float32's speed here; --dtype float32 serves faster on this machine")
        return 0
    targets = [(getattr(layer, part), name) for layer in model.layers
               for part, names in LINEAR_WEIGHTS.items() for name in names]
    tied = model.lm_head is None
    if not tied:
        targets.append((model, "lm_head"))
    gemm, in_place = gemm_kernel(), 0
    if tied:  # a copy: the embedding stays plain for its lookups
        model.lm_head = model.embed_tokens
        targets.append((model, "lm_head"))
    for module, name in targets:
        plain = getattr(module, name).detach()
        param = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(plain), requires_grad=False)
        if gemm is not None and gemm_layout_matches(plain, param):
            param.gemm = gemm
            in_place += 1
        setattr(module, name, param)  # the plain one is freed (not the tied embedding)
        module.packed = True
    log.info("linear weights packed for oneDNN: %d%s; %d of them read in place by the native GEMM",
             len(targets), " (the tied lm_head as a copy of the embedding)" if tied else "", in_place)
    return len(targets)


def gemm_layout_matches(plain: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether oneDNN packed the [N, K] ``plain`` weight as ``packed_gemm.c`` reads it:
    blocks of 64 rows of N, each [K/2][64][2], nothing else in the buffer. Compares the
    bytes, so a layout that only happens to give the same sums cannot pass."""
    n, k = plain.shape
    if plain.dtype != torch.bfloat16 or n % 64 or k % 2 or torch.ops.mkldnn._nbytes(packed) != n * k * 2:
        return False
    raw = (ctypes.c_int16 * (n * k)).from_address(torch.ops.mkldnn.data_ptr(packed))
    want = plain.view(n // 64, 64, k // 2, 2).transpose(1, 2).reshape(-1).view(torch.int16)
    return torch.equal(torch.frombuffer(raw, dtype=torch.int16), want)
