"""What a request does to the logits before sampling: a grammar's token bitmask, logit_bias and
min_tokens, and the presence / frequency / repetition penalties, in vLLM's order and by its rules.

vLLM applies the grammar bitmask to the logits before its sampler, computes the logprobs it
reports from those ("raw_logprobs"), then applies min_tokens and logit_bias, then the penalties
(repetition first: a seen token's logit divided by the penalty when positive, multiplied when
not; then frequency × output count and presence × seen-in-output subtracted), then temperature
and top-k / top-p. `masked` and `processed` below are those two points.

Every input has a size that does not grow with the vocabulary, so a host uploads little per step:
the bitmask is V/32 words a row; penalties come as up to P (token id, output count) pairs a row
(the prompt's and the output's distinct tokens, `-1` pads), logit_bias as up to L (token id,
bias) pairs (`-1` pads; min_tokens adds the stop tokens at -inf). The graph scatters them into
vocabulary-wide rows. A row with none of them (all-ones mask, no pairs, penalties 0 / 1) comes
out unchanged, and what it costs is a few elementwise passes over its logits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LogitInputs(NamedTuple):
    """A graph's logit-processing inputs, one row per sampled position (None: not in the bundle)."""

    bitmask: torch.Tensor | None  # [N, ceil(V/32)] int32: bit v % 32 of word v // 32 allows v
    penalty_ids: torch.Tensor | None  # [N, P] int64 distinct prompt/output tokens, -1 pads
    penalty_counts: torch.Tensor | None  # [N, P] float32 times each occurs in the output
    presence: torch.Tensor | None  # [N] float32
    frequency: torch.Tensor | None  # [N] float32
    repetition: torch.Tensor | None  # [N] float32, 1: off
    bias_ids: torch.Tensor | None  # [N, L] int64, -1 pads
    bias_values: torch.Tensor | None  # [N, L] float32 (-inf: banned, min_tokens' stop tokens)

    @classmethod
    def of(cls, inputs: dict[str, torch.Tensor], names: tuple[str, ...]) -> LogitInputs:
        """From a graph's inputs by name (`names` in field order; absent ones None)."""
        return cls(*(inputs.get(name) for name in names))

    def per_position(self, tokens: int) -> LogitInputs:
        """A verify graph's rows of T positions as B*T rows: each row's values repeated, the
        bitmask already one per position ([B, T, W])."""
        mask = self.bitmask
        rest = LogitInputs(
            None, *(None if t is None else t.repeat_interleave(tokens, dim=0) for t in self[1:])
        )
        return rest if mask is None else rest._replace(bitmask=mask.reshape(-1, mask.shape[-1]))


NONE = LogitInputs(None, None, None, None, None, None, None, None)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens to -inf. Bit i of a word as (word // 2**i) & 1 on its unsigned value:
    shifts have no StableHLO lowering in torch-mlir, and the powers of two come from arange
    (a tensor constant would be lifted out of the graph, which the neuron target refuses)."""
    rows, vocab = logits.shape
    words = bitmask.to(torch.int64) & 0xFFFFFFFF  # [N, W], unsigned
    lanes = torch.arange(32, device=logits.device, dtype=torch.float32)
    powers = torch.exp2(lanes).to(torch.int64)  # exact in float32 up to 2**31
    bits = torch.div(words.unsqueeze(-1), powers, rounding_mode="trunc") & 1  # [N, W, 32]
    allowed = bits.reshape(rows, -1)[:, :vocab] != 0
    return logits.masked_fill(~allowed, float("-inf"))


def _scatter(rows: int, vocab: int, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[N, V] zeros with `values` added at `ids` (pads, id -1, add nothing)."""
    valid = ids >= 0
    index = torch.where(valid, ids, 0).clamp(max=vocab - 1)
    src = torch.where(valid, values, torch.zeros_like(values))
    dense = torch.zeros(rows, vocab, dtype=values.dtype, device=values.device)
    return dense.scatter_add(1, index, src)


def process(logits: torch.Tensor, c: LogitInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [N, V] → float32 (masked: what logprobs are reported from, processed: what is
    sampled from; None when the graph has no logit inputs: the same)."""
    logits = logits.float()
    if all(t is None for t in c):
        return logits, None
    rows, vocab = logits.shape
    masked = logits if c.bitmask is None else apply_bitmask(logits, c.bitmask)
    x = masked
    if c.bias_ids is not None and c.bias_values is not None:
        x = x + _scatter(rows, vocab, c.bias_ids, c.bias_values)
    if c.penalty_ids is not None and c.penalty_counts is not None:
        assert c.presence is not None and c.frequency is not None and c.repetition is not None
        ids = c.penalty_ids
        seen = _scatter(rows, vocab, ids, torch.ones_like(c.penalty_counts)) > 0  # prompt|output
        counts = _scatter(rows, vocab, ids, c.penalty_counts)  # output occurrences
        penalty = torch.where(seen, c.repetition.unsqueeze(1), 1.0)
        x = torch.where(x > 0, x / penalty, x * penalty)
        x = x - c.frequency.unsqueeze(1) * counts
        x = x - c.presence.unsqueeze(1) * (counts > 0).to(x.dtype)
    return masked, x
