"""An embed bundle's graph output: each sequence's final hidden states over its tokens in the
chunk, pooled (abi.POOLED). What needs every chunk of a long input (the mean's division, the
first chunk's first token) is the host's: a chunk's graph sees only its own tokens."""

from __future__ import annotations

import torch


def pool(states: torch.Tensor, last: torch.Tensor, rule: str) -> torch.Tensor:
    """[S, H] float32 from the packed row's final states [T, H] and each sequence's last token
    in the row [S] (sequences lie side by side; those past the real ones pad, their index 0):
    the last token's state ("last"), the first's ("cls"), or the sum over the tokens ("mean")."""
    tokens = states.shape[0]
    end = last.clamp(0, tokens - 1)  # clamped like every index from the host (audit NK303)
    if rule == "last":
        return states.index_select(0, end).float()
    first = torch.cat([last.new_zeros(1), last[:-1] + 1])  # each sequence starts after the last
    if rule == "cls":
        return states.index_select(0, first.clamp(0, tokens - 1)).float()
    at = torch.arange(tokens, device=states.device).unsqueeze(0)  # [1, T]
    mine = (at >= first.unsqueeze(1)) & (at <= last.unsqueeze(1))  # [S, T]; padding: none
    return mine.float() @ states.float()
