"""Rotary position embeddings: the default frequencies and DeepSeek's YaRN scaling, applied in
the rotate-half layout (GLM, Qwen) or on interleaved channel pairs (DeepSeek's `rope_interleave`).

Shapes: T tokens, R rotary channels per head. cos/sin are computed in float32, scaled by YaRN's
attention factor, and cast to the activation dtype, as transformers does.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from runtime.model.config import ModelConfig, YarnScaling


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, y: YarnScaling) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies [R/2] and the factor cos/sin are multiplied by."""
    if y.attention_factor is not None:
        attention_factor = float(y.attention_factor)
    elif y.mscale and y.mscale_all_dim:
        attention_factor = yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(y.factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (y.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def softmax_scale(cfg: ModelConfig, qk_head_dim: int) -> float:
    """Attention's score scale: 1/sqrt(D), times YaRN's mscale squared when `mscale_all_dim` is set."""
    scale = qk_head_dim ** -0.5
    y = cfg.rope_scaling
    if y is not None and y.mscale_all_dim:
        scale *= yarn_mscale(y.factor, y.mscale_all_dim) ** 2
    return scale


class RotaryEmbedding(nn.Module):
    """cos/sin of the first `rotary_dim` channels of each head at given positions."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dim = cfg.rotary_dim
        if cfg.rope_scaling is None:
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_factor = 1.0
        else:
            inv_freq, self.attention_factor = yarn_inv_freq(dim, cfg.rope_theta, cfg.rope_scaling)
        self.interleaved = cfg.rope_interleave
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim] in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, R] with R <= D; channels past R pass through.

    `interleaved`: channel pairs (0, 1), (2, 3), ... rotate together and come out de-interleaved
    (evens' results, then odds'), as transformers' `apply_rotary_pos_emb_interleave`; queries and
    keys both take this layout, so their products are unchanged."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    if interleaved:
        c, s = cos[:, None, :half], sin[:, None, :half]
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x_pass), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)
