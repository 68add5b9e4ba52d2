"""Paged KV cache: per-layer K and V tensors, separate allocations (the scheduler hands out
their blocks; block 0 is the null block).

Separate per-layer tensors, never views of one buffer: overlapping views create a
synthetic base in AOTAutograd, and offsets past 2**32 into a giant buffer truncate on Neuron.
"""

from __future__ import annotations

import torch


def allocate_kv_cache(
    num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu"
) -> list[torch.Tensor]:
    """[k_cache.0, v_cache.0, k_cache.1, ...], each [num_blocks, block_size, kv_heads, head_dim]."""
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * num_layers)]
