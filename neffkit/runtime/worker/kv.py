"""Paged KV cache: per-layer K and V tensors, separate allocations (the scheduler hands out
their blocks; block 0 is the null block).

Separate per-layer tensors, never views of one buffer: overlapping views create a
synthetic base in AOTAutograd, and offsets past 2**32 into a giant buffer truncate on Neuron.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def allocate_kv_cache(
    shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, device: str = "cpu"
) -> list[torch.Tensor]:
    """The cache tensors of the layout's kv_names ([k_cache.0, v_cache.0, ...], or one latent
    `kv_cache.i` per layer for MLA), each [blocks, block_size, kv_heads, width]; blocks is the
    layer's KV group's pool."""
    return [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
