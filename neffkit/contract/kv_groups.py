"""KV groups: the layers that keep the same keys share one block pool and one block table.

As vLLM's hybrid KV cache manager: a full-attention layer (and Llama 4's chunked one) keeps every
position of a sequence; a sliding-window layer of window W reads only the last W keys, so its
group keeps only the blocks a step can still read and gives the others back as the sequence
advances. Each group has its own cache tensors (sized by its pool, so a sliding layer's cache is
window-sized in the bundle), its own block tables and its own slot mapping.

Group 0 comes first (the full group where there is one); its block tables and slot mapping keep
their plain input names, group g > 0's take a `.g` suffix (abi.group_input). A group's block
table keeps the logical layout of the full one (entry j: the block of positions j*bs ..
(j+1)*bs - 1), so masks and the kernel's key ranges are unchanged; entries that fell out of the
window point at the null block and are never read (they are outside every query's window).

Imports nothing from neffkit and no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from neffkit.contract.codec import Record


@dataclass(frozen=True)
class KVGroup(Record):
    """One group as built: its layers, its window (None: every position), its pool (null block 0
    included) and the most blocks one sequence holds at once."""

    layers: tuple[int, ...]
    window: int | None
    num_blocks: int
    blocks_per_seq: int


def window_blocks(window: int, chunk: int, block_size: int) -> int:
    """Blocks a sliding sequence holds at most: the window's keys behind a chunk of `chunk`
    tokens and the chunk's own. A chunk that starts on a block boundary needs exactly
    ceil((W + chunk) / bs); the scheduler shortens a chunk that starts inside a block
    (first_live, chunk_limit) so that no step needs more."""
    return -(-(window + chunk) // block_size)


def plan_groups(
    windows: Sequence[int | None], block_size: int, context: int, chunk: int
) -> list[tuple[int | None, tuple[int, ...], int]]:
    """(window, layers, blocks per sequence) of each group: the full group first, then each
    window from the smallest. A window whose blocks would cover the largest context saves
    nothing and joins the full group."""
    full_blocks = context // block_size
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        if window is not None and window_blocks(window, chunk, block_size) >= full_blocks:
            window = None
        by_window.setdefault(window, []).append(layer)
    order = sorted(by_window, key=lambda w: -1 if w is None else w)
    return [
        (w, tuple(by_window[w]), full_blocks if w is None else window_blocks(w, chunk, block_size))
        for w in order
    ]


def size_groups(
    plan: list[tuple[int | None, tuple[int, ...], int]],
    full_blocks: int,
    context_blocks: int,
    budget_blocks: int | None = None,
) -> tuple[KVGroup, ...]:
    """Each group's pool. `full_blocks`: the pool a full-context layer gets (the manifest's
    num_blocks, null block included), i.e. (full_blocks - 1) / context_blocks sequences of the
    largest context; a sliding group gets as many sequences' worth of its blocks_per_seq.
    `budget_blocks` (kv_cache.memory_mb): layer-blocks the budget holds, split by need, so the
    same number of sequences fits every group."""
    if budget_blocks is not None:
        per_seq = sum(len(layers) * bps for _, layers, bps in plan)
        seqs = max(1, budget_blocks // per_seq)
    else:
        seqs = max(1, (full_blocks - 1) // context_blocks)
    return tuple(
        KVGroup(
            layers,
            window,
            full_blocks if window is None and budget_blocks is None else seqs * bps + 1,
            bps,
        )
        for window, layers, bps in plan
    )


def first_live(window: int | None, position: int, block_size: int) -> int:
    """The first block a query at `position` (and every later one) still reads: the block of
    key position - W + 1; 0 for a full group."""
    if window is None:
        return 0
    return max(0, position - window + 1) // block_size


def chunk_limit(window: int, blocks_per_seq: int, start: int, block_size: int) -> int:
    """The most tokens a chunk starting at `start` may take so the sliding group's sequence
    holds at most `blocks_per_seq` blocks (at least one block's worth less one token)."""
    return (first_live(window, start, block_size) + blocks_per_seq) * block_size - start


def layer_groups(groups: Sequence[KVGroup], num_layers: int) -> tuple[int, ...]:
    """Each layer's group index (all 0 without groups)."""
    out = [0] * num_layers
    for g, group in enumerate(groups):
        for layer in group.layers:
            out[layer] = g
    return tuple(out)


def group_input(name: str, group: int) -> str:
    """KV group `group`'s slot mapping or block tables: the plain name for group 0."""
    return name if group == 0 else f"{name}.{group}"


def is_group_input(name: str, base: str) -> bool:
    """`name` is `base` of some KV group (`block_tables`, `block_tables.1`, ...)."""
    head, _, group = name.partition(".")
    return head == base and (not group or group.isdigit())
