"""Which replica serves a request: the one whose prefix cache holds most of its prompt, unless
that one is far busier than the least loaded, else the least loaded (SGLang's cache-aware
policy, by outstanding tokens; vLLM's router hashes prefixes the same way).

Each replica's prompts are remembered as chained hashes of their full blocks (kv_blocks.py's,
so a hash means what the engine's prefix cache means by it), in a bounded LRU per replica; a
request's match is the longest chain of its block hashes a replica has seen. A replica that
restarts forgets everything (its cache is empty).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from neffkit.runtime.engine.kv_blocks import BlockHash, extend_hashes

# the share of a prompt a replica must hold cached for the prompt to follow it (SGLang's
# cache_threshold)
CACHE_THRESHOLD = 0.5
# the cached replica is passed over where its outstanding tokens exceed the least loaded one's
# by both of these (SGLang's balance thresholds, in tokens here)
BALANCE_TOKENS = 8192
BALANCE_RATIO = 4.0
REMEMBERED_BLOCKS = 1 << 16  # block hashes kept per replica


class PrefixRouter:
    """Routing state over `replicas` engines of block size `block_size`; not thread-safe (the
    group holds its lock around `choose`)."""

    def __init__(self, replicas: int, block_size: int) -> None:
        self.block_size = block_size
        self.seen: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(replicas)]

    def choose(
        self, prompt_ids: Sequence[int], loads: Sequence[int | None], key: str | None
    ) -> int:
        """The replica for a prompt (run with adapter `key`, which the cache keys by), given
        each replica's outstanding tokens (None: down; one at least is up)."""
        chain: list[BlockHash] = []
        extend_hashes(chain, prompt_ids, self.block_size, key)
        live = [i for i, load in enumerate(loads) if load is not None]
        least = min(live, key=lambda i: (loads[i], i))
        best, matched = least, 0
        for i in live:
            n = self._matched(i, chain)
            if n > matched:
                best, matched = i, n
        cached = matched * self.block_size >= CACHE_THRESHOLD * len(prompt_ids) and matched
        if not cached or self._imbalanced(loads[best] or 0, loads[least] or 0):
            best = least
        self._remember(best, chain)
        return best

    def forget(self, replica: int) -> None:
        self.seen[replica].clear()

    def _matched(self, replica: int, chain: list[BlockHash]) -> int:
        """Leading blocks of `chain` the replica has seen (a block's hash holds its prefix)."""
        seen = self.seen[replica]
        for n, h in enumerate(chain):
            if h not in seen:
                return n
        return len(chain)

    @staticmethod
    def _imbalanced(busy: int, least: int) -> bool:
        return busy - least > BALANCE_TOKENS and busy > BALANCE_RATIO * least

    def _remember(self, replica: int, chain: list[BlockHash]) -> None:
        seen = self.seen[replica]
        for h in reversed(chain):  # a prompt's first blocks the most recent: evicted last
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > REMEMBERED_BLOCKS:
            seen.popitem(last=False)
