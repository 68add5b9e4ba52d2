"""A sequence's KV blocks in every KV group: what it holds, what a step needs, what it gives back.

Each KV group (contract/kv_groups.py) has its own pool and prefix cache (kv_blocks.BlockPool).
A sequence's list in a group is indexed by logical block (entry j holds positions j*bs ..
(j+1)*bs - 1), so one block hash names the same tokens in every group. A full group holds every
block of the sequence; a sliding group (window W) gives back the blocks no later query reads
(those before first_live at the step's first query) and keeps 0, the null block, in their place:
vLLM's SlidingWindowManager. A full group takes a prompt's blocks at admission, as before
groups; a sliding group takes each chunk's blocks as the chunk is scheduled.

A prefix hit must hold in every group: in a full group, the blocks of the prefix; in a sliding
group, only the blocks inside the window at the first uncached token (vLLM's rule), so a cached
prefix longer than the window is still a hit.

Pure Python, like kv_blocks.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from neffkit.contract.kv_groups import KVGroup, chunk_limit, first_live
from neffkit.runtime.engine.kv_blocks import BlockHash, BlockPool
from neffkit.runtime.worker.batch import SequenceState

NULL = 0  # a sliding group's entry whose block was given back


def held(blocks: Sequence[int]) -> list[int]:
    """The blocks a group's list holds (its given-back entries left out)."""
    return [b for b in blocks if b != NULL]


class GroupPools:
    """Every KV group's pool, and the rules for a sequence's blocks across them."""

    def __init__(self, groups: Sequence[KVGroup], block_size: int, caching: bool) -> None:
        self.groups = tuple(groups)
        self.block_size = block_size
        self.pools = [BlockPool(g.num_blocks, caching) for g in groups]

    @property
    def usage(self) -> float:
        """The fullest group's share of its pool in use."""
        return max(1.0 - p.num_free / p.num_usable for p in self.pools)

    # ------------------------------------------------------------------ prefix cache
    def cached_prefix(self, hashes: Sequence[BlockHash]) -> list[list[int]]:
        """Each group's cached blocks for the longest prefix of `hashes` every group can start
        from (NULL before a sliding group's window); every list empty on a miss."""
        full = [
            len(p.lookup(hashes))
            for g, p in zip(self.groups, self.pools, strict=True)
            if g.window is None
        ]
        n = min(full, default=len(hashes))
        while True:  # a sliding group may shorten the prefix; the others must hold it too
            shorter = min(self._window_hit(g, n, hashes) for g in range(len(self.groups)))
            if shorter == n:
                break
            n = shorter
        return [self._hit_blocks(g, n, hashes) for g in range(len(self.groups))]

    def _window_hit(self, g: int, n: int, hashes: Sequence[BlockHash]) -> int:
        """The longest prefix of at most `n` blocks group g can start from."""
        group = self.groups[g]
        if group.window is None:
            return n
        while n > 0 and not self._in_cache(g, n, hashes):
            n -= 1
        return n

    def _in_cache(self, g: int, n: int, hashes: Sequence[BlockHash]) -> bool:
        first = first_live(self.groups[g].window, n * self.block_size, self.block_size)
        return len(self.pools[g].lookup(hashes[first:n])) == n - first

    def _hit_blocks(self, g: int, n: int, hashes: Sequence[BlockHash]) -> list[int]:
        if n == 0:
            return []
        first = first_live(self.groups[g].window, n * self.block_size, self.block_size)
        return [NULL] * first + self.pools[g].lookup(hashes[first:n])

    # ------------------------------------------------------------------ what steps need
    def needs(self, held: Sequence[Sequence[int]], end: int, full_end: int) -> list[int]:
        """Fresh blocks each group needs after the blocks it `held` so a step's tokens up to
        `end` (exclusive) have theirs; a full group covers `full_end` (a prompt's blocks are
        taken at admission). Trim first: what a sliding group gives back is free by then."""
        bs, out = self.block_size, []
        for g, group in enumerate(self.groups):
            upto = -(-(full_end if group.window is None else end) // bs)
            out.append(max(0, upto - (len(held[g]) if g < len(held) else 0)))
        return out

    def peak_needs(
        self,
        hits: Sequence[Sequence[int]],
        need: Sequence[int],
        tokens: int,
        prefilling: Sequence[SequenceState] = (),
    ) -> list[int]:
        """What admission checks is free: `need` (what it takes now), and in a sliding group
        the most the sequence will hold as its prompt of `tokens` goes through, plus what the
        `prefilling` sequences will still take. A sliding group's blocks are taken chunk by
        chunk: without this, a full group's room would admit more prompts than the sliding
        pool can carry, and they would preempt each other."""
        peak = list(need)
        for g, group in enumerate(self.groups):
            if group.window is None:
                continue
            ahead = sum(self._to_take(g, len(s.prefill_ids), s.kv_blocks) for s in prefilling)
            peak[g] = max(need[g], self._to_take(g, tokens, hits)) + ahead
        return peak

    def _to_take(self, g: int, tokens: int, blocks: Sequence[Sequence[int]]) -> int:
        """Blocks sliding group g's sequence of `tokens` prompt tokens has yet to take."""
        mine = len(held(blocks[g])) if g < len(blocks) else 0
        most = min(self.groups[g].blocks_per_seq, -(-tokens // self.block_size))
        return max(0, most - mine)

    def chunk_tokens(self, start: int, tokens: int) -> int:
        """At most `tokens` tokens from `start` that every sliding group's sequence can hold
        (kv_groups.chunk_limit)."""
        for group in self.groups:
            if group.window is not None:
                tokens = min(
                    tokens, chunk_limit(group.window, group.blocks_per_seq, start, self.block_size)
                )
        return tokens

    def short(
        self, need: Sequence[int], hits: Sequence[Sequence[int]] = (), watermark: float = 0.0
    ) -> bool:
        """Does some group lack `need` fresh blocks (taking its `hits` out of the free queue
        too), with a `watermark` share of its pool (at least one block, where asked) left?"""
        for g, pool in enumerate(self.pools):
            mine = held(hits[g]) if hits else []
            spare = max(1, int(watermark * pool.num_usable)) if watermark else 0
            if need[g] + pool.free_among(mine) + spare > pool.num_free:
                return True
        return False

    def admit(self, seq: SequenceState, hits: Sequence[Sequence[int]], need: Sequence[int]) -> None:
        """Take the cached blocks `hits` and `need` fresh ones after them, in every group."""
        seq.kv_blocks = []
        for g, pool in enumerate(self.pools):
            mine = list(hits[g]) if hits else []
            pool.take(held(mine))
            seq.kv_blocks.append(mine + pool.allocate(need[g]))

    def trim(self, seq: SequenceState, position: int) -> None:
        """Give back each sliding group's blocks that no query from `position` on reads."""
        for g, group in enumerate(self.groups):
            if group.window is None or g >= len(seq.kv_blocks):
                continue
            blocks = seq.kv_blocks[g]
            first = min(first_live(group.window, position, self.block_size), len(blocks))
            gone = held(blocks[:first])
            if gone:
                self.pools[g].free(gone[::-1])
                blocks[:first] = [NULL] * first

    def grow(self, seq: SequenceState, need: Sequence[int]) -> None:
        for g, pool in enumerate(self.pools):
            if need[g] > 0:
                seq.kv_blocks[g] += pool.allocate(need[g])

    def register(self, seq: SequenceState, index: int, h: BlockHash) -> None:
        """Cache logical block `index` under its hash in every group still holding it."""
        for g, pool in enumerate(self.pools):
            blocks = seq.kv_blocks[g]
            if index < len(blocks) and blocks[index] != NULL:
                pool.register(blocks[index], h)

    def release(self, seq: SequenceState) -> None:
        """Every group's blocks back, tail first (the least shared part is evicted first)."""
        for g, pool in enumerate(self.pools):
            if g < len(seq.kv_blocks):
                pool.free(held(seq.kv_blocks[g][::-1]))
        seq.kv_blocks = []
