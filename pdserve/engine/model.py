"""Decoder-only transformer compatible with Hugging Face Llama, Mistral, Qwen2 and Qwen3
checkpoints.

RMSNorm, rotary embeddings (``rope.Rotary``: ``rope_theta`` and RoPE scaling, half-
rotation layout as in HF), grouped-query attention, SwiGLU MLP, optional QKV bias
(Qwen2; Llama and Qwen3 with ``attention_bias``, which also biases o_proj), optional
per-head q/k RMSNorm (Qwen3) and tied embeddings. Q/K/V and
gate/up projections are fused into one matmul each; the loader splits checkpoint
tensors into the fused parameters. Parameters are created empty (no random init),
so building a large model costs nothing before its weights are copied in.

With tensor parallelism (``parallel.TensorParallel``) each rank builds only its shard:
its query and KV heads, its slice of the MLP; o_proj and down_proj all-reduce.

Every projection goes through ``prepack.linear``: on a CPU with bfloat16 matmuls the
loader may have replaced the linear weights by oneDNN-packed ones after loading.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import AttentionMetadata, paged_attention
from pdserve.engine.config import ModelConfig
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.prepack import linear
from pdserve.engine.rope import Rotary, rotate


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _native(module: nn.Module, x: torch.Tensor):
    """The elementwise kernels (``native.Elementwise``) where ``module`` has them
    (``use_native``) and ``x`` is a tensor they read on an eager step; else None."""
    kernels = module.native
    if kernels is None or torch.compiler.is_compiling() or not kernels.takes(x):
        return None
    return kernels


class RMSNorm(nn.Module):
    native = None  # native.Elementwise, set by use_native

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = _param(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and (kernels := _native(self, x)) is not None:
            return kernels.rms_norm(x, self.weight, self.eps)
        orig = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(orig)


class Attention(nn.Module):
    native = None  # native.Elementwise, set by use_native

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TensorParallel,
                 window: int | None = None):
        super().__init__()
        self.tp = tp
        self.packed = False  # prepack.prepack_linears packed its weights
        self.window = window  # sliding window of this layer (None: full attention)
        self.num_heads = tp.split(cfg.num_attention_heads)[1]  # this rank's
        self.num_kv_heads = tp.kv_heads(cfg.num_key_value_heads)[1]
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        qkv = self.q_size + 2 * self.kv_size
        self.qkv_weight = _param(qkv, cfg.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = _param(qkv, dtype=dtype, device=device) if cfg.attention_bias else None
        self.o_weight = _param(cfg.hidden_size, self.q_size, dtype=dtype, device=device)
        self.o_bias = _param(cfg.hidden_size, dtype=dtype, device=device) if cfg.o_proj_bias else None
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """This layer's q, k and v of the normed input ``x``, rotated by ``rope``
        (``Rotary.at`` of the step's positions)."""
        t = x.shape[0]
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.packed)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:  # q and k side by side in qkv: rotated as one tensor
            qk = qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim)
            kernels = _native(self, qk)
            qk = rotate(*rope, qk) if kernels is None else kernels.rotate(*rope, qk)
            return qk[:, :self.num_heads], qk[:, self.num_heads:], v
        q = self.q_norm(qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim))
        k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim))
        return rotate(*rope, q), rotate(*rope, k), v

    def attend(self, q, k, v, kv_cache: torch.Tensor, meta: AttentionMetadata,
               on_kv_written=None) -> torch.Tensor:
        """``kv_cache``: [2, num_slots, KVH, D] for this layer."""
        return paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, on_kv_written,
                               self.window)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(linear(o.reshape(o.shape[0], self.q_size), self.o_weight, packed=self.packed))
        return out if self.o_bias is None else out + self.o_bias


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.packed = False  # prepack.prepack_linears packed its weights
        self.intermediate = tp.split(cfg.intermediate_size)[1]  # this rank's
        self.gate_up_weight = _param(2 * self.intermediate, cfg.hidden_size, dtype=dtype, device=device)
        self.down_weight = _param(cfg.hidden_size, self.intermediate, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_weight, packed=self.packed).split(self.intermediate, dim=-1)
        return self.tp.all_reduce(linear(F.silu(gate) * up, self.down_weight, packed=self.packed))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TensorParallel,
                 index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, dtype, device, tp, cfg.window_of(index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device, tp)


def use_native(model: nn.Module, kernels) -> None:
    """Give ``model``'s norms and rotary the elementwise kernels (a ``native.Elementwise``;
    None: torch's ops again). Only eager steps take them."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, Attention)):
            module.native = kernels


def before_attention(layer: DecoderLayer, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
    """A layer's dense part before attention: norm, q/k/v projection, q/k norm, rotary
    (``rope``: ``Rotary.at`` of the step's positions)."""
    return layer.self_attn.project(layer.input_layernorm(h), rope)


def after_attention(layer: DecoderLayer, h: torch.Tensor, o: torch.Tensor,
                    on_output=None) -> torch.Tensor:
    """A layer's dense part after attention: o projection, residual, norm, MLP, residual.
    ``on_output()`` fires once the o projection (and its all-reduce) returned."""
    h = h + layer.self_attn.output(o)
    if on_output is not None:
        on_output()
    return h + layer.mlp(layer.post_attention_layernorm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.num_kv_heads = tp.kv_heads(cfg.num_key_value_heads)[1]  # in this rank's KV cache
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, dtype, device, tp, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = (
            None if cfg.tie_word_embeddings
            else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.rotary = Rotary(cfg, device)
        self.compiled = None  # compiled.CompiledDense, once compiled.enable() has built it

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [L, 2, num_slots, KVH, D]
        meta: AttentionMetadata,
        kv_ready=None,  # optional callback(layer_index) once a layer's KV is in the cache
    ) -> torch.Tensor:
        h = F.embedding(input_ids, self.embed_tokens)
        # With tensor parallelism a layer's KV is whole on every rank only once o_proj's
        # all-reduce returned (each rank writes its heads before it joins), so the hook
        # fires after attention instead of between the cache write and attention.
        sharded = self.tp.size > 1
        before, after = self.dense_parts(input_ids.shape[0])
        rope = self.rotary.at(positions)
        for i, layer in enumerate(self.layers):
            hook = None if kv_ready is None else functools.partial(kv_ready, i)
            q, k, v = before(layer, h, rope)
            o = layer.self_attn.attend(q, k, v, kv_cache[i], meta, None if sharded else hook)
            h = after(layer, h, o, hook if sharded else None)
        return self.norm(h)

    def dense_parts(self, num_tokens: int):
        """The functions a step of ``num_tokens`` runs around each layer's attention: the
        compiled ones (``compiled.CompiledDense``) where they are on and pay, else eager."""
        if self.compiled is not None and self.compiled.covers(num_tokens):
            return self.compiled.before, self.compiled.after
        return before_attention, after_attention

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return linear(hidden, weight).float()
