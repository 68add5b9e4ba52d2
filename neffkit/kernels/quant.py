"""fp8 weight scales: their layout, and the dequantization inside the graph.

An fp8 weight ([..., out, in], float8_e4m3fn) has one float32 scale per [block_out, block_in]
block, the last blocks of each dimension partial. A block size of 0 spans the whole dimension,
so one layout covers DeepSeek's fine-grained blocks (128, 128), per-channel scales (1, 0) and a
per-tensor scale (0, 0). The graph widens the weight and multiplies each block by its scale
right before the projection that reads it, so Inductor can fuse the dequantization into the
projection's loop (one row: the weight is read as fp8 bytes once) and the bundle holds a quarter
of the float32 bytes. On the cpu target, where neffkit's kernel may read them (`Storage.fp8_lanes`:
`cpu_kernel: on`, or `auto` on a model with large projections), fp8 projection weights are
stored blocked (projection.py), their scales as `lane_scales`, and decode rows read the fp8
bytes in the kernel; elsewhere they stay plain and Inductor widens them inside its reduction.
"""

from __future__ import annotations

import torch

from neffkit.targets import E4M3FN_MAX


def effective_block(shape: tuple[int, ...] | list[int], block: tuple[int, ...]) -> tuple[int, int]:
    """The block in elements for a weight of `shape` (0 = the whole dimension)."""
    rows, cols = shape[-2:]
    return (block[0] or rows, block[1] or cols)


def scale_grid(shape: tuple[int, ...] | list[int], block: tuple[int, ...]) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of `shape`: its last two dims counted in blocks."""
    *lead, rows, cols = shape
    b = effective_block(shape, block)
    return (*lead, -(-rows // b[0]), -(-cols // b[1]))


def expand_scales(
    scale: torch.Tensor, shape: tuple[int, ...] | list[int], block: tuple[int, ...]
) -> torch.Tensor:
    """One float32 scale per element of a weight of `shape` (checkpoint scales in any of the
    shapes the formats use: [R, C] blocks, [out, 1] channels, [] or [1] for the tensor)."""
    rows, cols = shape[-2:]
    b = effective_block(shape, block)
    grid = scale.float().reshape(scale_grid(shape, block))
    per_row = grid.repeat_interleave(b[0], dim=-2)[..., :rows, :]
    return per_row.repeat_interleave(b[1], dim=-1)[..., :cols].contiguous()


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale per block in the `scale_grid` layout), the scale the
    block's largest magnitude over 448 (1 for an all-zero block): weight ≈ fp8.float() * scale,
    as DeepSeek's and llm-compressor's fp8 checkpoints are made. Works on meta tensors."""
    w = weight.float()
    rows, cols = w.shape[-2:]
    b = effective_block(tuple(w.shape), block)
    padded = torch.nn.functional.pad(w, (0, -cols % b[1], 0, -rows % b[0]))
    blocks = padded.unflatten(-1, (-1, b[1])).unflatten(-3, (-1, b[0]))
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., row blocks, col blocks]
    scale = torch.where(amax > 0, amax / E4M3FN_MAX, torch.ones_like(amax))
    expanded = expand_scales(scale, tuple(w.shape), block)
    q = (w / expanded).clamp(-E4M3FN_MAX, E4M3FN_MAX).to(torch.float8_e4m3fn)
    return q, scale.reshape(scale_grid(tuple(w.shape), block))


def dequantize_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """`weight.float() * scale` per block, cast to the compute dtype ([..., out, in]).

    Per-channel and per-tensor scales broadcast directly. Blocks are a broadcast over a block
    view of the (padded) weight, not a repeat of the scales per element: Inductor (torch 2.13,
    cpu) miscompiled the repeat_interleave and gather forms for weights with 16 rows or fewer
    when materialised for `mm` (errors up to 1e38; a [16, 72] weight at block 16). This form
    matched eager at every shape tried."""
    rows, cols = weight.shape[-2:]
    b = effective_block(tuple(weight.shape), block)
    wide = weight.to(torch.float32)
    if b[1] == cols and b[0] in (1, rows):  # scale [.., out, 1] or [.., 1, 1]
        return (wide * scale).to(dtype)
    pad_rows, pad_cols = -rows % b[0], -cols % b[1]
    if pad_rows or pad_cols:
        wide = torch.nn.functional.pad(wide, (0, pad_cols, 0, pad_rows))
    blocks = wide.unflatten(-1, (-1, b[1])).unflatten(-3, (-1, b[0]))  # [.., R, br, C, bc]
    scaled = blocks * scale.unsqueeze(-1).unsqueeze(-3)
    return scaled.flatten(-2).flatten(-3, -2)[..., :rows, :cols].to(dtype)


def lane_scales(
    grid: torch.Tensor, shape: tuple[int, ...] | list[int], block: tuple[int, ...], lanes: int
) -> torch.Tensor:
    """An [out, in] weight's block scales (`scale_grid` layout) for its blocked form
    [out/lanes, in, lanes]: [out/lanes, in-blocks, lanes], lane j of output block b the scale
    of output b*lanes + j, so a kernel scales a whole output tile per K block with one vector."""
    rows = shape[-2]
    b = effective_block(shape, block)
    per_row = grid.float().repeat_interleave(b[0], dim=0)[:rows]  # [out, in-blocks]
    return per_row.reshape(rows // lanes, lanes, -1).transpose(1, 2).contiguous()


def dequantize_blocked(
    weight: torch.Tensor, scales: torch.Tensor, k_block: int, dtype: torch.dtype
) -> torch.Tensor:
    """A blocked fp8 weight [NB, K, L] times its `lane_scales` [NB, KB, L], in `dtype`: each K
    block's rows broadcast against one scale vector (the broadcast form, as `dequantize_blocks`)."""
    nb, k, lanes = weight.shape
    wide = weight.to(torch.float32)
    pad = -k % k_block
    if pad:
        wide = torch.nn.functional.pad(wide, (0, 0, 0, pad))
    blocks = wide.reshape(nb, -1, k_block, lanes) * scales.unsqueeze(2)
    return blocks.reshape(nb, -1, lanes)[:, :k].to(dtype)
