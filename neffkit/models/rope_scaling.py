"""RoPE frequencies as transformers computes them, at build time: `inv_freq` and the cos/sin scale.

The definition is transformers' `modeling_rope_utils` (`ROPE_INIT_FUNCTIONS`); each function here
repeats its float32 arithmetic step for step (the tests compare them bit for bit), without
importing transformers, which is not a dependency of neffkit. The graphs take `inv_freq` as an
input (`rope.inv_freq`, float32, stored with the weights) and multiply cos/sin by the attention
factor, a constant of the graph.

Supported: `default`, `linear`, `llama3`, `yarn` (with its attention factor / mscale), and
`dynamic` / `longrope` while the largest context bucket stays within the lengths where HF's
frequencies never change. Beyond them HF recomputes the frequencies from the longest sequence
seen in a forward call (`dynamic` even keeps the longest ever seen), which a graph with static
frequencies cannot reproduce: such a manifest is refused with that reason.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    return 1.0 / (base**exponent)


def rope_frequencies(params: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32, attention factor) as HF's init function returns them."""
    kind, base, dim = params["rope_type"], float(params["rope_theta"]), head_dim
    if kind in ("default", "dynamic"):  # dynamic: equal to default within check_static's bound
        return _default_inv_freq(base, dim), 1.0
    if kind == "linear":
        return _default_inv_freq(base, dim) / params["factor"], 1.0
    if kind == "llama3":
        return _llama3(params, base, dim), 1.0
    if kind == "yarn":
        return _yarn(params, base, dim)
    return _longrope_short(params, base, dim)


def _llama3(params: dict[str, Any], base: float, dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, dim)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def yarn_mscale(scale: float, mscale: float = 1) -> float:
    """YaRN's magnitude correction for a context `scale` (HF's get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _context_factor(params: dict[str, Any]) -> tuple[int, float]:
    """(original_max_position_embeddings, factor); without a factor, HF takes the ratio of
    max_position_embeddings to the original length (DeepSeek, Phi-3)."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    return original, params["max_position_embeddings"] / original if factor is None else factor


def _yarn(params: dict[str, Any], base: float, dim: int) -> tuple[torch.Tensor, float]:
    original, factor = _context_factor(params)
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(
                yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            )
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(dtype=torch.float)
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _longrope_short(params: dict[str, Any], base: float, dim: int) -> tuple[torch.Tensor, float]:
    """longrope's frequencies below original_max_position_embeddings (the short factors)."""
    original, factor = _context_factor(params)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    ext_factors = torch.tensor(params["short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * base**shape), float(attention_factor)
