"""Rotary position embedding (rotate-half layout).

The frequencies (`inv_freq`, float32) come from the build (models/rope_scaling.py, HF's formulas
for every rope type) as a graph input; cos/sin are computed in-graph from int positions in
float32 and scaled by the rope type's attention factor, exactly as HF's rotary embedding does.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor,  # [B, T] int64
    inv_freq: torch.Tensor,  # [D/2] float32
    attention_factor: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [B, T, 1, D]
    freqs = positions.float().unsqueeze(-1) * inv_freq.float()  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:  # yarn / longrope scale cos and sin (HF's attention_scaling)
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype).unsqueeze(2), sin.to(dtype).unsqueeze(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, heads, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: pairs (x0, x1), (x2, x3), ... each rotated by one frequency, written
    back de-interleaved (evens then odds) as HF's `apply_rotary_pos_emb_interleave` does; q and
    k get the same permutation, so their dot products are those of the interleaved rotation."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
