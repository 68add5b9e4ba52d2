"""A graph call's sampled outputs as the scheduler reads them: tokens, and the logprobs of the rows
that asked. A grammar's mask leaves -inf among a row's top logprobs when it allows fewer tokens
than asked for; those read as -9999.0, as vLLM's OpenAI server writes them (JSON has no -inf)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from neffkit.contract import abi

FLOOR = -9999.0


def _floor(values: list[float]) -> tuple[float, ...]:
    return tuple(max(v, FLOOR) for v in values)


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's logprobs: the token's own, and the N most likely tokens' (ids, values)."""

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


class StepOutput:
    """A graph call's outputs by name; logprobs are read out only for the rows that asked."""

    def __init__(self, arrays: dict[str, np.ndarray], graph: str = "") -> None:
        self.arrays = arrays
        self.graph = graph  # the graph that ran (the thread governor times each apart)
        # an embed bundle's graphs sample nothing (abi.POOLED instead)
        sampled = arrays.get(abi.NEXT_TOKENS)
        self.tokens: list[int] = sampled.tolist() if sampled is not None else []

    def logprobs(self, row: int, top: int, position: int | None = None) -> TokenLogprobs:
        """Row `row`'s logprobs (a verify step's: at `position` of the row)."""
        a = self.arrays
        at = row if position is None else (row, position)
        return TokenLogprobs(
            max(float(a[abi.TOKEN_LOGPROBS][at]), FLOOR),
            tuple(a[abi.TOP_LOGPROB_IDS][at][:top].tolist()),
            _floor(a[abi.TOP_LOGPROBS][at][:top].tolist()),
        )

    def prompt_logprobs(self, positions: range, top: int) -> list[TokenLogprobs]:
        """Chunk positions' logprobs of the prompt token after each (prefill graphs built with
        sampling.prompt_logprobs)."""
        a = self.arrays
        chosen = a[abi.PROMPT_LOGPROBS][positions.start : positions.stop].tolist()
        ids = a[abi.PROMPT_TOP_LOGPROB_IDS][positions.start : positions.stop, :top].tolist()
        values = a[abi.PROMPT_TOP_LOGPROBS][positions.start : positions.stop, :top].tolist()
        return [
            TokenLogprobs(c, tuple(i), tuple(v))
            for c, i, v in zip(chosen, ids, values, strict=True)
        ]
