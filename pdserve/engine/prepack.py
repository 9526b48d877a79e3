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

Invariant: ``linear(x, w, b)`` gives what ``F.linear(x, w, b)`` gives on the plain
weight, whichever form ``w`` has (bit for bit in every SmolLM2 shape, 1 to 1,600 rows,
torch 2.13; the tests hold the greedy ids equal).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

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
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if packed:
        return packed_linear(x, weight, bias)
    return F.linear(x, weight, bias)


@torch.library.custom_op("pdserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
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
    for module, name in targets:
        packed = torch.ops.mkldnn._reorder_linear_weight(getattr(module, name).detach())
        setattr(module, name, nn.Parameter(packed, requires_grad=False))  # the plain one is freed
        module.packed = True
    if tied:  # a copy: the embedding stays plain for its lookups
        packed = torch.ops.mkldnn._reorder_linear_weight(model.embed_tokens.detach())
        model.lm_head = nn.Parameter(packed, requires_grad=False)
    log.info("linear weights packed for oneDNN: %d%s", len(targets) + tied,
             " (the tied lm_head as a copy of the embedding)" if tied else "")
    return len(targets) + tied
