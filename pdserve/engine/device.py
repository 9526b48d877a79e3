"""The one place that knows about accelerators: ``cpu``, ``cuda`` and ``npu``.

``npu`` works through ``torch_npu`` when it is installed. Everything else in the
engine takes a ``torch.device`` and stays device-agnostic.

On CUDA, PyTorch's cuDNN attention backend is turned off for the process: it builds
an execution plan for every new shape, and the engine's attention changes shape every
step (a decode's context grows by a token, prompts differ in length), so each step
would pay a plan build (``benchmarks/sdpa_new_shape.py``). Flash and memory-efficient
attention take any shape with no build.
"""

from __future__ import annotations

import torch

from pdserve.engine.config import ConfigError


def prepare_device(device: str, num_threads: int | None = None) -> torch.device:
    kind = device.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but no CUDA device is available")
    if kind == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise ConfigError("device 'npu' requires the torch_npu package") from None
    if num_threads:
        torch.set_num_threads(num_threads)
    return torch.device(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]
