"""Rotary position embeddings: inverse frequencies per scaling type, and the cos/sin tables.

``inv_freq(cfg)`` turns a ``ModelConfig``'s ``rope_theta`` and ``rope_scaling`` into the
per-pair inverse frequencies and the factor that multiplies cos and sin (YaRN's
attention scaling; 1 otherwise), following the definitions Hugging Face transformers
uses for the same config fields, so a checkpoint runs the positions it was trained on:

- ``default`` and ``dynamic``: ``theta ** (-2i / head_dim)``. Dynamic NTK only changes
  the base once a sequence is longer than ``max_position_embeddings``, and the engine
  never serves past that length, so within it dynamic is the default table.
- ``linear``: the default frequencies divided by ``factor``.
- ``llama3``: wavelengths longer than ``original / low_freq_factor`` are divided by
  ``factor``, shorter than ``original / high_freq_factor`` kept, and those in between
  blended linearly in ``original / wavelength``.
- ``yarn``: a ramp over the pair index between the dimensions that rotate ``beta_fast``
  and ``beta_slow`` times in ``original`` positions blends extrapolated (default) and
  interpolated (``/ factor``) frequencies; cos and sin are scaled by
  ``attention_factor`` (default ``0.1 ln(factor) + 1``, or the mscale ratio).

Types the parser in ``config.py`` does not accept never reach here. ``Rotary`` owns
the tables (built once at model construction, on the model's device) and applies
them in the half-rotation layout of HF checkpoints.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.engine.config import ModelConfig, RopeScaling


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(base: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_freq_wavelen, base / s.factor, base)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(theta: float, dim: int, s: RopeScaling) -> tuple[torch.Tensor, float]:
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention = _yarn_mscale(s.factor)

    def correction_dim(num_rotations: float) -> float:
        # The pair index whose wavelength fits num_rotations times into the original length.
        return dim * math.log(s.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    interpolated = extrapolated / s.factor
    keep = 1 - ramp  # 1: high frequency, extrapolate; 0: low frequency, interpolate
    return interpolated * (1 - keep) + extrapolated * keep, attention


def inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies ``[head_dim // 2]``, cos/sin scale) for ``cfg``; pure, CPU."""
    dim, theta, s = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    if s is None or s.rope_type == "dynamic":
        return _default_inv_freq(theta, dim), 1.0
    if s.rope_type == "linear":
        return _default_inv_freq(theta, dim) / s.factor, 1.0
    if s.rope_type == "llama3":
        return _llama3(_default_inv_freq(theta, dim), s), 1.0
    if s.rope_type == "yarn":
        return _yarn(theta, dim, s)
    raise AssertionError(f"rope type {s.rope_type!r} passed the config parser")


class Rotary(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position; built by ``Transformer``."""

    def __init__(self, cfg: ModelConfig, device: torch.device):
        super().__init__()
        freqs_per_pair, scale = inv_freq(cfg)
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, freqs_per_pair)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(device), persistent=False)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) ``[T, 1, D]`` of ``positions``: looked up once per step, every layer
        rotates with them (``rotate``)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate(cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, heads, D]`` rotated by ``Rotary.at``'s tables (HF's half-rotation layout,
    in float32, rounded back to ``x``'s dtype). Elementwise: rotating q and k as one
    tensor gives each exactly what rotating it alone does."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
