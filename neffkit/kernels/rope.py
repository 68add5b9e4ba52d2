"""Rotary position embedding (rotate-half layout, HF's default rope type).

cos/sin are computed in-graph from int positions in float32, exactly as HF does, so no host tensor
and no non-persistent buffer (which torch-mlir trips on) is needed.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor,  # [B, T] int64
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [B, T, 1, D]
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (exponent / head_dim))  # [D/2]
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    return emb.cos().to(dtype).unsqueeze(2), emb.sin().to(dtype).unsqueeze(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, heads, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
