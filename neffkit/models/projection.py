"""How a graph writes `x @ weight.T`, and the blocked weight layout the CPU forms read.

A decode step is bandwidth-bound: each projection should stream its weight once, whatever the
number of rows. On the CPU, Inductor's fused C++ reductions do that at one row; with several rows
a plain-layout reduction streams the weight once per row, and `mm` (oneDNN/MKL) reads it at
~12 GB/s here. The forms below read a *blocked* weight, stored in the bundle as
[out/LANES, in, LANES] (still a plain strided graph input, one copy for every graph):

- "blocked-rows" (decode, up to `max_rows` rows): one reduction per row over the same weight
  tile; Inductor fuses them into one loop whose body loads a LANES-wide weight vector once and
  feeds every row's accumulator (a register-blocked GEMV: bench/batch.py, LAB.md).
- "blocked-bmm" (prefill, larger buckets): `matmul` against the blocks, a bmm of
  [T, in] x [in, LANES] per block (as fast as `mm` at 128 rows here).

- "kernel-rows" (decode, cpu with AVX-512): neffkit's own C++ kernel on the same blocked
  weights (neffkit/platform/csrc/blocked_rows.cpp): each weight vector, loaded once (bf16 widened in
  register), feeds every row's accumulator held in registers, with the weight lines prefetched
  ahead; Inductor's reductions keep neither the rows nor the stream that way. bf16 rows on bf16
  weights use AMX tiles where the CPU has them (the FMA path is compute-bound at 8 bf16 rows).
  Called through the dispatcher (~3 us a call), so "auto" takes it only for weights of at least
  `kernel_min_bytes`; the manifest's `compiler.cpu_kernel` says on/off/auto.

Other forms: "reduction" (plain layout, a single row, the original GEMV form), "mm", and "dot"
(neuron: neuronx-cc needs the `dot` to put a projection on the TensorEngine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neffkit.kernels.quant import dequantize_blocked
from neffkit.models.forms import ProjectionPolicy


@dataclass(frozen=True)
class BlockedFp8:
    """A blocked fp8 projection weight [out/L, in, L] with its `lane_scales` [out/L, KB, L]:
    decode rows read its bytes in the kernel (`blocked_rows_fp8`); other forms dequantize."""

    weight: torch.Tensor
    scales: torch.Tensor
    k_block: int

    @classmethod
    def of(cls, weight: torch.Tensor, scales: torch.Tensor, k_block: int) -> BlockedFp8:
        """From a checkpoint's K block size, where 0 (per-channel, per-tensor) is the whole K."""
        return cls(weight, scales, k_block or weight.shape[1])


def to_blocked(weight: torch.Tensor, lanes: int) -> torch.Tensor:
    """[out, in] → [out/lanes, in, lanes], contiguous: lane j of block b is output b*lanes + j."""
    out_features, in_features = weight.shape
    return weight.reshape(out_features // lanes, lanes, in_features).transpose(1, 2).contiguous()


def from_blocked(weight: torch.Tensor) -> torch.Tensor:
    """The plain [out, in] weight again (tests, tools)."""
    nb, in_features, lanes = weight.shape
    return weight.transpose(1, 2).reshape(nb * lanes, in_features)


def out_features(weight: torch.Tensor | BlockedFp8) -> int:
    """A projection weight's output size, plain or blocked."""
    if isinstance(weight, BlockedFp8):
        weight = weight.weight
    return weight.shape[0] * weight.shape[2] if weight.dim() == 3 else weight.shape[0]


def materialized(x: torch.Tensor) -> torch.Tensor:
    """x, stored once in its own buffer by Inductor before the projection reads it.

    Otherwise Inductor inlines the producer (the RMSNorm, SwiGLU) into the reduction's inner
    loop, recomputing it for every weight tile (the LM head of a 125M model, 8 rows: ~30 ms a
    step), or realises the whole [tiles, in, lanes] product (bf16: 0.5 GB a step). An identity
    `as_strided` is the one view Inductor's lowering must realise its input for; eagerly it is
    a free view."""
    x = x.contiguous()
    return torch.as_strided(x, x.shape, x.stride())


def project(
    x: torch.Tensor, weight: torch.Tensor | BlockedFp8, policy: ProjectionPolicy
) -> torch.Tensor:
    """x @ weight.T for a plain [out, in] or blocked [out/L, in, L] weight (module docstring)."""
    lead, in_features = x.shape[:-1], x.shape[-1]
    rows = x.numel() // in_features
    if isinstance(weight, BlockedFp8):
        fp8 = weight
        if policy.form(rows, True, fp8.weight.numel()) == "kernel-rows":
            # bf16 rows as they are (the kernel's VDPBF16PS path reads them), others float32
            x2 = x.reshape(rows, in_features)
            x2 = materialized(x2 if x.dtype == torch.bfloat16 else x2.float())
            out = torch.ops.neffkit.blocked_rows_fp8(x2, fp8.weight, fp8.scales, fp8.k_block)
            return out.to(x.dtype).reshape(*lead, out.shape[-1])
        weight = dequantize_blocked(fp8.weight, fp8.scales, fp8.k_block, x.dtype)
    nbytes = weight.numel() * weight.element_size()
    form = policy.form(rows, weight.dim() == 3, nbytes)  # bundle.json records the forms
    if form == "kernel-rows":
        # float32 accumulation, one cast per output; bf16 rows stay bf16 on bf16 weights
        # (the kernel's AMX path reads them as they are), others go to float32 once
        x2 = x.reshape(rows, in_features)
        x2 = materialized(x2 if x.dtype == weight.dtype == torch.bfloat16 else x2.float())
        out = torch.ops.neffkit.blocked_rows(x2, weight)  # float32 [rows, out]
        return out.to(x.dtype).reshape(*lead, out.shape[-1])
    if form.startswith("blocked"):
        nb, _, lanes = weight.shape
        x2 = x.reshape(rows, in_features)
        if form == "blocked-rows":
            # the rows in float32 once (bf16: no conversion per row and weight tile)
            xf = materialized(x2.float())
            # one reduction per row over the same tile: Inductor fuses them and loads each
            # weight vector once for every row; float32 accumulation, one cast per output
            per_row = [
                (xf[r][None, :, None] * weight.float()).sum(1).reshape(nb * lanes)
                for r in range(rows)
            ]
            out = torch.stack(per_row).to(x.dtype)
        else:
            out = torch.matmul(x2.unsqueeze(0), weight)  # [nb, rows, L]
            out = out.permute(1, 0, 2).reshape(rows, nb * lanes)
        return out.reshape(*lead, nb * lanes)
    if form == "reduction":
        return (x.unsqueeze(-2) * weight).sum(-1)
    return x @ weight.t()  # "mm", "dot"
