"""RMSNorm computed in float32 and cast back before the weight multiply, as HF Llama does
(GPT-OSS multiplies the weight in float32 and casts after: `weight_in_float32`)."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_float32: bool = False
) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_float32:
        return (weight.float() * h).to(dtype)
    return weight * h.to(dtype)
