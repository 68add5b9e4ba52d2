"""KV blocks: the pool the scheduler allocates from, and the prefix cache inside it.

As vLLM v1 (`vllm/v1/core/kv_cache_utils.py`, `block_pool.py`): each *full* block of a sequence
has a hash chaining its parent block's hash, its token ids and extra keys (None here; room for an
adapter id), so equal hashes mean equal prefixes and equal K/V. A block whose tokens are all in
the cache is registered under its hash. When its last user lets go it joins the free queue, still
registered: a later request with the same prefix takes it back (reference count + 1) instead of
recomputing it, and a fresh allocation takes the least recently freed block first, dropping its
hash (eviction). Only full blocks are shared; a sequence's last partial block is its own. Block 0
is the null block (padding slots land there): never handed out.

Pure Python: the scheduler's tests run it against a fake runner in milliseconds.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

BlockHash = bytes
# the parent of a sequence's first block (vLLM's NONE_HASH, fixed here so hashes are stable)
ROOT_HASH: BlockHash = hashlib.sha256(b"neffkit prefix cache").digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: Any = None) -> BlockHash:
    """One full block's hash: sha256 over (parent hash, token ids, extra keys)."""
    return hashlib.sha256(pickle.dumps((parent, tuple(token_ids), extra), protocol=4)).digest()


def extend_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra: Any = None
) -> None:
    """Append the hashes of the full blocks of `token_ids` that `hashes` does not cover yet."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra))


class BlockPool:
    """Blocks 1..num_blocks-1 with reference counts, an LRU free queue and the hash → block map
    of cached blocks. With `caching` off, freed blocks keep no hash and nothing is looked up."""

    def __init__(self, num_blocks: int, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.caching = caching
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, BlockHash] = {}
        self._cached: dict[BlockHash, int] = {}
        # free blocks, least recently freed first (the first evicted); values unused
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.evictions = 0  # cached blocks handed out fresh (their prefix dropped)

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached ones among them: reusable or evictable)."""
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (not taken yet)."""
        blocks = []
        if self.caching:
            for h in hashes:
                block = self._cached.get(h)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def free_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` sit in the free queue (taking them shrinks it)."""
        return sum(self._refs[b] == 0 for b in blocks)

    def take(self, blocks: Sequence[int]) -> None:
        """One more user of each cached block (out of the free queue if it was there)."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks, the least recently freed first; a cached one loses its hash."""
        if count > len(self._free):
            raise MemoryError(f"{count} KV blocks requested, {len(self._free)} free")
        out = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(block, None)
            if h is not None:
                del self._cached[h]
                self.evictions += 1
            self._refs[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """One user fewer for each block; a sequence's blocks are given last first, so its tail
        (the least shared part) is evicted before its head."""
        for b in blocks:
            self._refs[b] -= 1
            assert self._refs[b] >= 0, f"block {b} freed twice"
            if self._refs[b] == 0:
                self._free[b] = None

    def register(self, block: int, h: BlockHash) -> None:
        """Cache a full block under its hash; a hash already cached keeps its first block (the
        duplicate stays private and is freed as any block)."""
        if not self.caching or h in self._cached or block in self._hash_of:
            return
        self._cached[h] = block
        self._hash_of[block] = h
