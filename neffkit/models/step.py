"""What every layer of one forward reads (`Step`), built once per forward by the decoder."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from neffkit.kernels import attention as attn

# which keys a layer's queries see: (sliding window, attention chunk), None for unbounded
Span = tuple[int | None, int | None]


@dataclass
class Step:
    """What every layer of one forward reads: weights by name, this rank, the layers' caches,
    RoPE, the attention masks per window, the flat slots and block tables."""

    w: dict[str, torch.Tensor]
    rank: torch.Tensor | None  # [1] int64: this graph's rank, as data (tp > 1, ep > 1)
    caches: tuple[torch.Tensor, ...]  # per layer: (k, v), or (latent,) for MLA
    cos: torch.Tensor  # [B, T, 1, D]
    sin: torch.Tensor
    masks: dict[Span, torch.Tensor]  # (window, chunk) → [B, T, C] (packed: [1, T, S*C])
    # per KV group (contract/kv_groups.py): its slots [B*T] and block tables [B, C/bs]
    # (packed: [1, S*C/bs])
    group_slots: tuple[torch.Tensor, ...]
    group_tables: tuple[torch.Tensor, ...]
    positions: torch.Tensor  # [B, T] int64 (packed: [1, T])
    # a second rotation some layers use instead of (cos, sin) (Gemma 3's sliding layers)
    local_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # attention through neffkit's kernel: each span's (lo, hi, block tables) per query, the
    # visible keys lo..hi [B*T] and the table each reads [B*T, C/bs] (the masks are not built)
    bounds: dict[Span, tuple[torch.Tensor, ...]] | None = None
    # an fp8 cache with rotated keys: this step at the context keys' positions [1, C] (packed:
    # every sequence's), whose RoPE puts each key's offset back (Decoder.key_offsets)
    context: Step | None = None

    @property
    def slots(self) -> torch.Tensor:
        """The first KV group's slots (the only group of most bundles)."""
        return self.group_slots[0]

    @property
    def block_tables(self) -> torch.Tensor:
        """The first KV group's block tables."""
        return self.group_tables[0]


def key_views(
    rows: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int],
    tables: list[torch.Tensor],
    spans: dict[Span, int],
    kernel: bool,
) -> tuple[
    dict[Span, torch.Tensor], dict[Span, tuple[torch.Tensor, ...]] | None, list[torch.Tensor]
]:
    """The keys each span's queries see: with the attention kernel, each query's bounds and
    block table (through its span's KV group's tables); else the masks [B, T, C] (packed: [1, T,
    S*C], the tables then side by side [1, S*C/bs]). `rows`: positions, sequence ids (packed
    prefill, else None), context lengths and the context bucket; `spans`: each span's group."""
    positions, seq_ids, context_lens, context = rows
    if kernel and seq_ids is not None:  # each token: its sequence's keys
        packed = (positions, seq_ids, context_lens)
        return (
            {},
            {s: attn.packed_visible_keys(*packed, tables[g], *s) for s, g in spans.items()},
            tables,
        )
    if kernel:  # decode, verify: each query's key range in its row
        return (
            {},
            {
                s: attn.visible_keys(positions, context_lens, tables[g], *s)
                for s, g in spans.items()
            },
            tables,
        )
    if seq_ids is not None:  # packed: one row attending to every sequence's context
        masks = {
            s: attn.packed_context_mask(positions, seq_ids, context_lens, context, *s)
            for s in spans
        }
        return masks, None, [t.reshape(1, -1) for t in tables]
    return {s: attn.context_mask(positions, context_lens, context, *s) for s in spans}, None, tables
