"""Integer weights with int8 activations per block of 32 inputs: llama.cpp's arithmetic for its
quantized formats (a Q8_0 / Q4_1 / K-quant matmul quantizes the activations to 8 bits per
block, then sums integer products), opt-in by the manifest (`quantization.activations: int8`).

Each projection's input row is cut into blocks of 32 inputs; a block's values become int8 with
the block's own scale (absmax / 127, round half to even: the rounding of W8A8's per-token
scheme, per block as llama.cpp's Q8_0), so a value is `q * d` (`quantize_blocks`). The product
is then the quantized rows times the weight's exact values (`dequantize`'s): in the graph the
dequantized rows through the weight-only forms (`fake_quantized`), on CPU builds through
neffkit::int8_blocks (csrc/int8_blocks.cpp), which sums `q * code` in int32 and scales each
block's partial sums: the same quantity, in a different float32 rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from neffkit.kernels.intquant import SCALE, PackedWeight, QuantScheme

BLOCK = 32  # inputs a block of one row shares a scale


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 32) → (int8 values as float32 [..., K/32, 32], scale
    [..., K/32, 1]): per block, scale absmax / 127 (1 for an all-zero block), values
    x * (127 / absmax) (a true division) rounded half to even, clamped to +-127; every step
    one float32 operation (the kernel quantizes the same way, bit for bit)."""
    xf = x.float().unflatten(-1, (-1, BLOCK))
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(xf * inverse).clamp(-127, 127), scale


def fake_quantized(x: torch.Tensor) -> torch.Tensor:
    """x's rows as the blocks' int8 values times their scales, in x's dtype: what a weight-only
    form multiplies by the weight to compute the int8-activation product."""
    q, scale = quantize_blocks(x)
    return (q * scale).flatten(-2).to(x.dtype)


KINDS = {"sym": 0, "zero": 1, "min": 2}  # neffkit::int8_blocks' `kind`


def blocks_kernel_scheme(scheme: QuantScheme, in_features: int) -> bool:
    """Does neffkit::int8_blocks (csrc/int8_blocks.cpp) read a weight of this scheme: int8-block
    activations on 4- or 8-bit integer codes, `in_features` and the group whole multiples of 32
    inputs? (The build's layout asks this of the scheme ids alone.)"""
    if scheme.activations != "int8-block" or scheme.kind not in KINDS:
        return False
    whole = in_features % BLOCK == 0 and scheme.group_of(in_features) % BLOCK == 0
    return scheme.bits in (4, 8) and whole


def blocks_kernel_reads(weight: PackedWeight) -> bool:
    """`blocks_kernel_scheme` for a weight in the graph (codes [out, in/2] or [out, in])."""
    codes, scheme = weight.parts[""], weight.scheme
    if codes.dim() != 2 or scheme.bits not in (4, 8):
        return False
    return blocks_kernel_scheme(scheme, codes.shape[-1] * 8 // scheme.bits)


def project_int8_blocks_kernel(
    x: torch.Tensor, weights: Sequence[PackedWeight]
) -> list[torch.Tensor]:
    """x @ W.T for each weight (one scheme) in one neffkit::int8_blocks call: the rows
    quantized per block as `quantize_blocks` does, integer products summed in int32."""
    lead, in_features = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, in_features)
    x2 = x2 if x2.dtype in (torch.float32, torch.bfloat16) else x2.float()  # exact widening
    scheme = weights[0].scheme
    codes, scales = [w.parts[""] for w in weights], [w.parts[SCALE] for w in weights]
    # kind sym reads no aux: the scales stand in (AOTInductor passes an empty list on as None)
    aux = [w.parts[scheme.aux] for w in weights] if scheme.aux else scales
    kind = KINDS[scheme.kind]
    out = torch.ops.neffkit.int8_blocks(x2, codes, scales, aux, scheme.bits, kind, scheme.zero)
    parts = out.split([w.out_features for w in weights], dim=-1)
    return [part.to(x.dtype).reshape(*lead, part.shape[-1]) for part in parts]
