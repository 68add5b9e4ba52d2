"""Paged KV cache: per-layer K and V tensors, separate allocations (the scheduler hands out
their blocks; block 0 is the null block).

Separate per-layer tensors, never views of one buffer: overlapping views create a
synthetic base in AOTAutograd, and offsets past 2**32 into a giant buffer truncate on Neuron.
"""

from __future__ import annotations

import torch


def allocate_kv_cache(
    count: int, shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu"
) -> list[torch.Tensor]:
    """`count` cache tensors (the layout's kv_names: [k_cache.0, v_cache.0, ...], or one latent
    `kv_cache.i` per layer for MLA), each [num_blocks, block_size, kv_heads, width]."""
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
