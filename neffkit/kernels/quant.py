"""Weight dequantization inside the graph: quantized bytes are what a step streams.

Block fp8 (DeepSeek's fine-grained format): a float8_e4m3fn weight and one float32 scale per
[block_out, block_in] block, the last blocks of each dimension partial. The graph widens the
weight and multiplies each block by its scale right before the projection that reads it, so
Inductor can fuse the dequantization into the projection's loop (one row: the weight is read as
fp8 bytes once) and the bundle holds a quarter of the float32 bytes.
"""

from __future__ import annotations

import torch


def dequantize_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """`weight.float() * scale` per block, cast to the compute dtype ([..., out, in]).

    Written as a broadcast over a block view of the (padded) weight, not by repeating the
    scales per element: Inductor (torch 2.13, cpu) miscompiled the repeat_interleave and gather
    forms for weights with 16 rows or fewer when materialised for `mm` (errors up to 1e38; a
    [16, 72] weight at block 16). This form matched eager at every shape tried."""
    rows, cols = weight.shape[-2:]
    wide = weight.to(torch.float32)
    pad_rows, pad_cols = -rows % block[0], -cols % block[1]
    if pad_rows or pad_cols:
        wide = torch.nn.functional.pad(wide, (0, pad_cols, 0, pad_rows))
    blocks = wide.unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0]))  # [.., R, br, C, bc]
    scaled = blocks * scale.unsqueeze(-1).unsqueeze(-3)
    return scaled.flatten(-2).flatten(-3, -2)[..., :rows, :cols].to(dtype)
