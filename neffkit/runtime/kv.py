"""Paged KV cache: per-layer K and V tensors (separate allocations) and a block allocator.

Block 0 is the null block: padding slots and -1 block-table entries land there, so it is never
handed out. Separate per-layer tensors, never views of one buffer: overlapping views create a
synthetic base in AOTAutograd, and offsets past 2**32 into a giant buffer truncate on Neuron.
"""

from __future__ import annotations

import torch


class BlockAllocator:
    """Free-list of KV blocks 1..num_blocks-1."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"{count} KV blocks requested, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def allocate_kv_cache(
    num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu"
) -> list[torch.Tensor]:
    """[k_cache.0, v_cache.0, k_cache.1, ...], each [num_blocks, block_size, kv_heads, head_dim]."""
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * num_layers)]
