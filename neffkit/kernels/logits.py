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
    """Disallowed tokens to -inf: `word & (1 << lane)` per token. The lane bits come from arange
    (shifts have no StableHLO lowering in torch-mlir, and a tensor constant would be lifted out
    of the graph, which the neuron target refuses); bit 31 is int32's sign bit."""
    rows, vocab = logits.shape
    lanes = torch.arange(32, device=logits.device)
    bits = torch.exp2(lanes.clamp(max=30).to(torch.float32)).to(torch.int32)  # exact
    bits = torch.where(lanes == 31, torch.full_like(bits, -(2**31)), bits)
    allowed = (bitmask.unsqueeze(-1) & bits) != 0  # [N, W, 32]
    return logits.masked_fill(~allowed.reshape(rows, -1)[:, :vocab], float("-inf"))


def _unmasked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`process`'s branch for an all-ones bitmask (a copy: a `torch.cond` branch may not return
    its input)."""
    return logits.clone()


def _index(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Pair ids as gather / scatter indices: pads (-1) point at token 0 and carry a zero."""
    return torch.where(ids >= 0, ids, 0).clamp(max=vocab - 1)


def process(
    logits: torch.Tensor, c: LogitInputs, branches: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [N, V] → float32 (masked: what logprobs are reported from, processed: what is
    sampled from; None when the graph has no logit inputs: the same).

    `branches` (Inductor targets): a step whose bitmask allows every token skips the masking
    pass (a `torch.cond`; 271 µs of 8 rows of 49 152 logits on a 2-core AMD EPYC).

    Biases and penalties touch only their pairs' tokens: the logits there are gathered, changed
    and added back (`scatter_add` of the differences; pads add zero), so a step makes one pass
    over the vocabulary for each, not several. A penalty pair's tokens are distinct."""
    logits = logits.float()
    if all(t is None for t in c):
        return logits, None
    vocab = logits.shape[1]
    if c.bitmask is None:
        masked = logits
    elif branches:
        restricted = (c.bitmask != -1).any()
        masked = torch.cond(restricted, apply_bitmask, _unmasked, (logits, c.bitmask))
    else:
        masked = apply_bitmask(logits, c.bitmask)
    x = masked
    if c.bias_ids is not None and c.bias_values is not None:
        valid = c.bias_ids >= 0
        bias = torch.where(valid, c.bias_values, torch.zeros_like(c.bias_values))
        x = x.scatter_add(1, _index(c.bias_ids, vocab), bias)
    if c.penalty_ids is not None and c.penalty_counts is not None:
        assert c.presence is not None and c.frequency is not None and c.repetition is not None
        index = _index(c.penalty_ids, vocab)
        seen = x.gather(1, index)  # [N, P]: the logits of the tokens seen so far
        repetition = c.repetition.unsqueeze(1)
        penalized = torch.where(seen > 0, seen / repetition, seen * repetition)
        counts = c.penalty_counts
        penalized = penalized - c.frequency.unsqueeze(1) * counts
        penalized = penalized - c.presence.unsqueeze(1) * (counts > 0).to(counts.dtype)
        live = (c.penalty_ids >= 0) & torch.isfinite(seen)  # a masked token stays -inf
        x = x.scatter_add(1, index, torch.where(live, penalized - seen, torch.zeros_like(seen)))
    return masked, x
