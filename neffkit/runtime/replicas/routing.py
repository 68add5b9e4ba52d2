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


def prompt_chain(prompt_ids: Sequence[int], block_size: int, key: str | None) -> list[BlockHash]:
    """The chained hashes of a prompt's full blocks (run with adapter `key`), as the engine's
    prefix cache hashes them."""
    chain: list[BlockHash] = []
    extend_hashes(chain, prompt_ids, block_size, key)
    return chain


class SeenBlocks:
    """One replica's remembered prompts: their block hashes, the most recent last, at most
    REMEMBERED_BLOCKS (the least recent dropped)."""

    def __init__(self) -> None:
        self.hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def matched(self, chain: list[BlockHash]) -> int:
        """Leading blocks of `chain` seen here (a block's hash holds its prefix)."""
        for n, h in enumerate(chain):
            if h not in self.hashes:
                return n
        return len(chain)

    def remember(self, chain: list[BlockHash]) -> None:
        for h in reversed(chain):  # a prompt's first blocks the most recent: evicted last
            self.hashes[h] = None
            self.hashes.move_to_end(h)
        while len(self.hashes) > REMEMBERED_BLOCKS:
            self.hashes.popitem(last=False)


class PrefixRouter:
    """Routing state over `replicas` engines of block size `block_size`; not thread-safe (the
    group holds its lock around `choose`)."""

    def __init__(self, replicas: int, block_size: int) -> None:
        self.block_size = block_size
        self.seen = [SeenBlocks() for _ in range(replicas)]

    def choose(
        self, prompt_ids: Sequence[int], loads: Sequence[int | None], key: str | None
    ) -> int:
        """The replica for a prompt (run with adapter `key`, which the cache keys by), given
        each replica's outstanding tokens (None: down; one at least is up)."""
        chain = prompt_chain(prompt_ids, self.block_size, key)
        live = [i for i, load in enumerate(loads) if load is not None]
        least = min(live, key=lambda i: (loads[i], i))
        best, matched = least, 0
        for i in live:
            n = self.seen[i].matched(chain)
            if n > matched:
                best, matched = i, n
        cached = matched * self.block_size >= CACHE_THRESHOLD * len(prompt_ids) and matched
        if not cached or self._imbalanced(loads[best] or 0, loads[least] or 0):
            best = least
        self.seen[best].remember(chain)
        return best

    def forget(self, replica: int) -> None:
        self.seen[replica] = SeenBlocks()

    @staticmethod
    def _imbalanced(busy: int, least: int) -> bool:
        return busy - least > BALANCE_TOKENS and busy > BALANCE_RATIO * least
