"""LoRA deltas for a batch that mixes adapters: every row's tokens through its own slot's A and
B, no loop over adapters. Two forms: the graph's own, two dense matmuls over all slots with a
one-hot mask between them (the same ops on every target's lowering; prefill), and on cpu decode
and verify rows neffkit::lora_rows (csrc/lora_rows.cpp), which reads only the slots the rows use
(punica's BGMV)."""

from __future__ import annotations

import torch

from neffkit.contract.lora import LORA_A, LORA_B


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


MASK, SLOTS = "lora.mask", "lora.slots"  # the step's entries in a graph's tensors by name


def step_inputs(
    w: dict[str, torch.Tensor],
    lora_slots: torch.Tensor,
    seq_ids: torch.Tensor | None,
    tokens: int,
    kernel: bool,
) -> None:
    """What every adapted projection of a step reads, added to the graph's tensors `w`: each
    token's slot ([N], flattened as the kernel reads rows) for neffkit::lora_rows, else the
    one-hot mask of `slot_mask`."""
    a = next(t for name, t in w.items() if name.endswith(LORA_A))  # [in, max_loras, rank]
    if kernel:  # decode, verify: one row per sequence, `tokens` tokens each
        slots = lora_slots.clamp(0, a.shape[1])
        w[SLOTS] = slots.unsqueeze(1).expand(-1, tokens).reshape(-1)
    else:
        w[MASK] = slot_mask(lora_slots, seq_ids, a.shape[1], a.dtype)


def adapted(
    x: torch.Tensor, w: dict[str, torch.Tensor], prefixes: tuple[str, ...], outs: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Each projection's output plus x through each token's adapter, for the `prefixes` that
    have slots (`lora:`); one neffkit::lora_rows call for all of them where the step takes the
    kernel. Under tp a row-parallel one's delta is a partial sum too, reduced with its output."""
    have = [i for i, p in enumerate(prefixes) if f"{p}.{LORA_A}" in w]
    if not have:
        return outs
    pairs = [(w[f"{prefixes[i]}.{LORA_A}"], w[f"{prefixes[i]}.{LORA_B}"]) for i in have]
    if SLOTS in w:
        deltas = lora_rows(x, pairs, w[SLOTS])
    else:
        deltas = [lora_delta(x, a, b, w[MASK]) for a, b in pairs]
    outs = list(outs)
    for i, delta in zip(have, deltas, strict=True):
        outs[i] = outs[i] + delta
    return outs


def lora_rows(
    x: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor
) -> list[torch.Tensor]:
    """Every projection's delta through neffkit::lora_rows (csrc/lora_rows.cpp), which reads
    only the slots the rows use."""
    lead, n_in = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, n_in).contiguous()
    out = torch.ops.neffkit.lora_rows(rows, [a for a, _ in pairs], [b for _, b in pairs], slots)
    parts = out.split([b.shape[2] for _, b in pairs], dim=-1)
    return [part.reshape(*lead, part.shape[-1]) for part in parts]
