"""What one ``scaled_dot_product_attention`` call costs on CUDA when its shape is new.

A serving engine's attention changes shape every step: a decode's context grows by
one token, and prompts differ in length. PyTorch's cuDNN attention backend builds an
execution plan for each new shape and caches it; the other backends (flash,
memory-efficient, math) launch a kernel whatever the shape. This times, for the
``small`` preset's heads (GQA 8/2, head_dim 64), a decode call (one query over L
keys) and a causal prefill call (L queries), each at 16 lengths never seen before
and then 16 times at one length already seen, with PyTorch's default backends and
with cuDNN's turned off; ``backend`` is the one PyTorch picks for that shape.

    python benchmarks/sdpa_new_shape.py     # needs a CUDA device
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
LENGTHS = range(300, 316)


def call_ms(q_len: int, kv_len: int, dtype: torch.dtype) -> tuple[float, str]:
    q = torch.randn(1, HEADS, q_len, HEAD_DIM, device="cuda", dtype=dtype)
    k = torch.randn(1, KV_HEADS, kv_len, HEAD_DIM, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    causal = q_len > 1
    try:
        backend = SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=causal, enable_gqa=True)).name
    except Exception as e:  # a private function: report, do not fail
        backend = f"? ({type(e).__name__})"
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, backend


def main() -> None:
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name(0)}; cuDNN attention enabled by default: "
          f"{torch.backends.cuda.cudnn_sdp_enabled()}")
    print("| dtype | cuDNN attention | call | backend | new shape, median ms | seen shape, median ms |")
    print("|---|---|---|---|---:|---:|")
    for dtype in (torch.bfloat16, torch.float32):
        for cudnn in (True, False):
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            for call, q_len in (("decode", lambda n: 1), ("prefill", lambda n: n)):
                call_ms(q_len(8), 8, dtype)  # load the kernels
                new = [call_ms(q_len(n), n, dtype) for n in LENGTHS]
                seen = [call_ms(q_len(LENGTHS[0]), LENGTHS[0], dtype)[0] for _ in LENGTHS]
                print(f"| {str(dtype).removeprefix('torch.')} | {'on' if cudnn else 'off'} | {call} "
                      f"| {new[0][1]} | {statistics.median(t for t, _ in new):.3f} "
                      f"| {statistics.median(seen):.3f} |", flush=True)
    torch.backends.cuda.enable_cudnn_sdp(True)


if __name__ == "__main__":
    main()
