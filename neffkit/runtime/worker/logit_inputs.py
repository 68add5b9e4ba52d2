"""A request's logit processing as the graphs take it (contract/abi.py `logit_inputs`): fixed-width
(token id, value) rows for penalties and biases, and a grammar's bitmask rows.

`Penalties` keeps a request's distinct tokens in first-seen order with their output counts, so
a step changes one pair; `write_row` lays a request out in one row of a graph's metadata (a row
with nothing to do gets the no-op padding, so reused decode buffers forget the last request);
`fill_bitmasks` asks each constrained row's matcher for its mask. Imports no torch.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from neffkit.contract import abi
from neffkit.runtime.sampling_params import SamplingParams


class Row(Protocol):
    """What a row's logit inputs come from (the scheduler's SequenceState)."""

    params: SamplingParams
    output_ids: list[int]
    penalties: Penalties | None


class MaskFiller(Protocol):
    """Writes matchers' next-token masks into bitmask rows (structured.Grammars)."""

    def fill(self, bitmask: np.ndarray, rows: list[tuple[Any, int]]) -> None: ...


class Penalties:
    """Distinct prompt (with a repetition penalty) and output tokens, and each one's output
    count, as the `penalty_ids` / `penalty_counts` pairs of one row (`-1` pads)."""

    def __init__(self, width: int, params: SamplingParams, prompt_ids: list[int]) -> None:
        self.ids = np.full(width, -1, np.int64)
        self.counts = np.zeros(width, np.float32)
        self._index: dict[int, int] = {}
        if params.repetition_penalty != 1.0:
            for token in dict.fromkeys(prompt_ids):
                self._slot(token)

    def _slot(self, token: int) -> int:
        i = self._index.get(token)
        if i is None:  # limits.check_fits bounded the distinct tokens by the width
            i = self._index[token] = len(self._index)
            self.ids[i] = token
        return i

    def add(self, token: int) -> None:
        """An output token."""
        self.counts[self._slot(token)] += 1

    @staticmethod
    def bound(params: SamplingParams, prompt_ids: list[int], max_tokens: int) -> int:
        """The most pairs a request can need: its distinct prompt tokens (with a repetition
        penalty) and one per output token."""
        prompt = len(set(prompt_ids)) if params.repetition_penalty != 1.0 else 0
        return prompt + max_tokens


def min_tokens_stops(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The tokens min_tokens bans while it holds: EOS (unless ignored) and the stop ids, once
    each."""
    eos = () if params.ignore_eos else eos_token_ids
    return tuple(dict.fromkeys((*eos, *params.stop_token_ids)))


def bias_pairs(seq: Row, eos_token_ids: tuple[int, ...]) -> list[tuple[int, float]]:
    """logit_bias, and the EOS and stop tokens at -inf while fewer than min_tokens are out."""
    p = seq.params
    pairs = list(p.logit_bias)
    if len(seq.output_ids) < p.min_tokens:
        pairs += [(t, float("-inf")) for t in min_tokens_stops(p, eos_token_ids)]
    return pairs


def stop_count(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> int:
    """The bias pairs min_tokens adds while it holds."""
    return len(min_tokens_stops(params, eos_token_ids)) if params.min_tokens else 0


def write_row(
    meta: dict[str, np.ndarray], row: int, seq: Row, eos_token_ids: tuple[int, ...]
) -> None:
    """A request's penalties and biases into row `row` of the graph's logit inputs (those the
    graph has), padding where it has none."""
    p = seq.params
    if abi.PENALTY_IDS in meta:
        penalties = seq.penalties
        if penalties is None:
            meta[abi.PENALTY_IDS][row] = -1
            meta[abi.PENALTY_COUNTS][row] = 0
        else:
            meta[abi.PENALTY_IDS][row] = penalties.ids
            meta[abi.PENALTY_COUNTS][row] = penalties.counts
        for name in abi.PENALTY_NAMES:  # presence, frequency, repetition
            meta[name][row] = getattr(p, name)
    if abi.BIAS_IDS in meta:
        pairs = bias_pairs(seq, eos_token_ids)
        ids, values = meta[abi.BIAS_IDS][row], meta[abi.BIAS_VALUES][row]
        ids[:] = -1
        values[:] = 0
        if pairs:
            ids[: len(pairs)] = [t for t, _ in pairs]
            values[: len(pairs)] = [v for _, v in pairs]


def fill_bitmasks(
    meta: dict[str, np.ndarray], matchers: list[Any], grammars: MaskFiller | None
) -> None:
    """Each row's grammar mask for its next token (a verify graph: at the row's first
    position); rows whose matcher is None, and the other positions, allow every token."""
    mask = meta.get(abi.TOKEN_BITMASK)
    if mask is None:
        return
    flat = mask.reshape(-1, mask.shape[-1])  # verify: [B*T, W], a row's positions in a run
    per_row = flat.shape[0] // mask.shape[0]
    flat[:] = -1
    rows = [(m, i * per_row) for i, m in enumerate(matchers) if m is not None]
    if rows:
        assert grammars is not None, "a request has a grammar but the engine has no grammars"
        grammars.fill(flat, rows)
