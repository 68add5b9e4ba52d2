"""Embed bundles' pooling: the graph's per-chunk rule (models/pooling.py) against a loop over
each sequence's tokens, and the host's combination of a long input's chunks (pooled.py) against
pooling the whole input at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neffkit.contract.records import PoolingRecord
from neffkit.models.pooling import pool
from neffkit.runtime.worker.pooled import PooledState

RULES = ("last", "mean", "cls")


@pytest.mark.parametrize("rule", RULES)
def test_a_packed_rows_pooling_is_each_sequences_own(rule):
    torch.manual_seed(0)
    states = torch.randn(16, 8)
    lengths = [3, 1, 7]  # side by side from token 0; tokens 11.. pad, as a fourth row does
    last = torch.tensor([2, 3, 10, 0])
    got = pool(states, last, rule)
    start = 0
    for row, n in enumerate(lengths):
        mine = states[start : start + n]
        want = {"last": mine[-1], "mean": mine.sum(0), "cls": mine[0]}[rule]
        torch.testing.assert_close(got[row], want)
        start += n
    if rule == "mean":  # a padding row pools nothing
        assert not got[3].any()


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("normalize", [True, False])
def test_chunks_combine_as_the_whole_input(rule, normalize):
    rng = np.random.default_rng(0)
    states = rng.standard_normal((37, 8))
    pooled = PooledState(PoolingRecord(rule, normalize, 8))
    for start in range(0, 37, 16):  # chunks of 16, 16 and 5 tokens
        chunk = states[start : start + 16]
        row = {"last": chunk[-1], "mean": chunk.sum(0), "cls": chunk[0]}[rule]
        pooled.add(row.astype(np.float32), start)
    want = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[rule]
    if normalize:
        want = want / np.linalg.norm(want)
    got = pooled.result(37)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
