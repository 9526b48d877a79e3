"""The dense parts of a layer compiled for prefill steps (``torch.compile``, inductor).

A prefill step of a few hundred tokens spends a third of its time outside the matmuls
and attention: norms, rotary, SiLU times up, residual adds and the casts between
them, each reading and writing a tensor of hundreds of rows once per op. Compiled,
inductor fuses them into a few loops. Only the parts around attention are compiled
(``model.before_attention`` and ``model.after_attention``): attention, its cache
write and the KV connector's per-layer hook stay eager between them, so the layer-
wise KV transfer fires exactly as on the eager path. The packed linears are opaque to
the compiler (``prepack.packed_linear``), so oneDNN still runs the matmuls.

Which steps: those of at least ``min_tokens`` tokens (``COMPILE_MIN_TOKENS``). A decode
step of a few rows gains nothing measurable (1.04x for a layer, docs/benchmarks.md)
and pays the guards of 60 compiled calls; a step mixing decodes with a prefill chunk
of that size takes the compiled path whole. One graph per part serves every layer and
every token count (``dynamic=True``): the layers differ only in their weights.

Where: CPU, bfloat16, weights packed, no tensor parallelism (the collective inside
``after_attention``). Start-up: ``enable`` compiles both parts before the engine
serves, by running them on a layer with a dummy input of two sizes; inductor's cache
(its default directory, or ``TORCHINDUCTOR_CACHE_DIR``) keeps the generated code across
restarts, so a restart compiles in seconds (SmolLM2 on one core: about 35 s cold, 5 s
from the cache). A compile longer than ``COMPILE_BUDGET_S`` lets the engine serve eager
meanwhile; it switches to the compiled parts when they are done. A compile that fails
leaves it eager (logged).

Greedy ids: the fused reductions sum in another order than eager torch, so logits
differ within bfloat16's rounding, and an argmax between two nearly equal logits can
differ; the tests hold compiled prefills to eager's ids on real prompts and to its
logits within a tolerance.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from pdserve.engine.model import Transformer, after_attention, before_attention

log = logging.getLogger(__name__)

COMPILE_MIN_TOKENS = 64
COMPILE_BUDGET_S = 120.0
SWITCH = "PDSERVE_COMPILE"  # "0": never compile (the engine's --no-compile-prefill)


class CompiledDense:
    """The compiled ``before_attention`` and ``after_attention`` of a model's layers, for
    steps of ``min_tokens`` or more (``Transformer.dense_parts`` asks ``covers``)."""

    def __init__(self, min_tokens: int = COMPILE_MIN_TOKENS) -> None:
        self.min_tokens = min_tokens
        self.before = torch.compile(before_attention, dynamic=True)
        self.after = torch.compile(after_attention, dynamic=True)

    def covers(self, num_tokens: int) -> bool:
        return num_tokens >= self.min_tokens


def can_compile(model: Transformer) -> str | None:
    """Why the dense parts of ``model`` are not compiled (None: they can be)."""
    weight = model.embed_tokens
    if os.environ.get(SWITCH) == "0":
        return f"{SWITCH}=0"
    if weight.device.type != "cpu":
        return f"device {weight.device.type}: compiled only on CPU"
    if weight.dtype != torch.bfloat16:
        return f"dtype {weight.dtype}: compiled only in bfloat16"
    if model.tp.size > 1:
        return "tensor parallelism: the all-reduce stays eager"
    if not all(layer.mlp.packed and layer.self_attn.packed for layer in model.layers):
        return "weights not packed"
    return None


def enable(model: Transformer, min_tokens: int = COMPILE_MIN_TOKENS,
           budget_s: float = COMPILE_BUDGET_S) -> bool:
    """Compile ``model``'s dense parts and use them for steps of ``min_tokens`` or more;
    called once by the engine before it serves. Waits for the compile up to
    ``budget_s``; past that the engine serves eager while it goes on, and takes the
    compiled parts when it is done. True once they are in use; False where
    ``can_compile`` says no, the compile failed, or it is still running."""
    why_not = can_compile(model)
    if why_not is not None:
        log.info("prefill not compiled: %s", why_not)
        return False
    done = threading.Event()

    def build() -> None:
        compiled, start = CompiledDense(min_tokens), time.monotonic()
        try:
            # Two sizes: the first compiles, the second shows the graph is not specialised
            # to one token count (a recompile per size would stall the first steps instead).
            for n in (min_tokens, 2 * min_tokens + 1):
                warm_up(model, compiled, n)
        except Exception:  # noqa: BLE001 - any compiler failure leaves the eager path, which works
            log.warning("prefill compile failed: serving eager", exc_info=True)
        else:
            model.compiled = compiled
            log.info("prefill compiled for steps of >= %d tokens in %.1f s", min_tokens,
                     time.monotonic() - start)
        finally:
            done.set()

    threading.Thread(target=build, name="compile-prefill", daemon=True).start()
    if not done.wait(budget_s):
        log.warning("prefill still compiling after %.0f s: serving eager until it is done", budget_s)
    return model.compiled is not None


@torch.inference_mode()
def warm_up(model: Transformer, compiled: CompiledDense, num_tokens: int) -> None:
    """Run both compiled parts once on layer 0 with ``num_tokens`` dummy rows."""
    layer, cfg = model.layers[0], model.config
    weight = model.embed_tokens
    h = torch.zeros(num_tokens, cfg.hidden_size, dtype=weight.dtype, device=weight.device)
    positions = torch.arange(num_tokens, device=weight.device)
    q, _, _ = compiled.before(layer, h, model.rotary.at(positions))
    compiled.after(layer, h, torch.zeros_like(q))  # attention's output: [T, H, D]
