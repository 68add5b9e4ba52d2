"""An embedding as its chunks arrive: what each prefill call of an embed bundle returned for one
sequence (abi.POOLED), combined once its last chunk is in, and scaled to unit length where the
bundle says so (its `PoolingRecord`)."""

from __future__ import annotations

import numpy as np

from neffkit.contract.records import PoolingRecord

EPS = 1e-12  # torch.nn.functional.normalize's floor on the norm


class PooledState:
    """One sequence's pooled states so far: the last chunk's last token ("last"), the first
    chunk's first ("cls"), or the running sum ("mean"), kept in float64."""

    def __init__(self, rule: PoolingRecord) -> None:
        self.rule = rule
        self.value: np.ndarray | None = None

    def add(self, chunk: np.ndarray, start: int) -> None:
        """A chunk's pooled row (the chunk beginning at token `start`)."""
        row = chunk.astype(np.float64)
        if self.rule.pooling == "cls":
            if start == 0:
                self.value = row
        elif self.rule.pooling == "mean" and self.value is not None:
            self.value = self.value + row
        else:  # last: every chunk's last token is later than the one before
            self.value = row

    def result(self, tokens: int) -> np.ndarray:
        """The embedding of a sequence of `tokens` tokens, float32."""
        assert self.value is not None, "no chunk was pooled"
        value = self.value / tokens if self.rule.pooling == "mean" else self.value
        if self.rule.normalize:
            value = value / max(float(np.linalg.norm(value)), EPS)
        return value.astype(np.float32)
