"""What every layer of one forward reads (`Step`), built once per forward by the decoder."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    slots: torch.Tensor  # [B*T]
    block_tables: torch.Tensor  # [B, C/bs] (packed: [1, S*C/bs])
    positions: torch.Tensor  # [B, T] int64 (packed: [1, T])
    # a second rotation some layers use instead of (cos, sin) (Gemma 3's sliding layers)
    local_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    # attention through neffkit's kernel: each span's (lo, hi, block tables) per query, the
    # visible keys lo..hi [B*T] and the table each reads [B*T, C/bs] (the masks are not built)
    bounds: dict[Span, tuple[torch.Tensor, ...]] | None = None
    # an fp8 cache with rotated keys: this step at the context keys' positions [1, C] (packed:
    # every sequence's), whose RoPE puts each key's offset back (Decoder.key_offsets)
    context: Step | None = None
