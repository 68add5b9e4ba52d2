"""LoRA deltas for a batch that mixes adapters: every row's tokens through its own slot's A and B,
as two dense matmuls over all slots with a one-hot mask between them (punica's BGMV as one
gathered product: no loop over adapters, no per-token gather of A and B, and the same ops on
every target's lowering)."""

from __future__ import annotations

import torch


def slot_mask(
    lora_slots: torch.Tensor, seq_ids: torch.Tensor | None, max_loras: int, dtype: torch.dtype
) -> torch.Tensor:
    """[lines, T or 1, max_loras, 1]: 1 where a token's row uses that slot. `lora_slots` [B] is
    each row's slot (0: the base, no adapter); a packed row's tokens take their sequence's.
    Slots out of range are clamped, like every index from the host (audit NK303)."""
    slots = lora_slots.clamp(0, max_loras)
    if seq_ids is not None:  # packed prefill: [1, T], each token's sequence
        per_token = slots[seq_ids.clamp(0, slots.shape[0] - 1)]
    else:  # one row per sequence ([B, 1]): every token of a row is its sequence's
        per_token = slots.unsqueeze(1)
    numbers = torch.arange(1, max_loras + 1, device=slots.device)
    return (per_token.unsqueeze(-1) == numbers).to(dtype).unsqueeze(-1)


def lora_delta(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """x [lines, T, in] through each token's adapter: (x @ A[slot]) @ B[slot], the scaling
    folded into B. a [in, L, R], b [L, R, out], mask from `slot_mask`."""
    slots, rank = a.shape[1], a.shape[2]
    xa = (x @ a.reshape(a.shape[0], slots * rank)).unflatten(-1, (slots, rank))
    return (xa * mask).flatten(-2) @ b.reshape(slots * rank, b.shape[2])
