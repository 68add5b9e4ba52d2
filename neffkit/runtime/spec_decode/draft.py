"""A draft model proposing K tokens greedily a step (speculation.method: draft).

The draft is a bundle of its own inside the target's (`draft/`: graphs, weights, a KV cache of
the target's block size and count), so one block table addresses both caches and the draft
writes a sequence's positions into the same blocks the target does. It prefills every prompt
chunk the target prefills. At each verify step it first catches up on the tokens its cache lacks
(the target's last token, and the last accepted draft when all K were accepted, or the tokens of
plain decode steps it sat out) through its verify-shaped graph of 1 + K tokens a row, whose
last real position gives the first draft; then K - 1 decode steps give the rest, each writing
its input's K/V. Drafts the target rejects leave stale K/V at positions the next catch-up
overwrites before anything attends to them. Greedy drafts are point masses, so the target's
verify graph accepts them by exact rejection sampling: outputs equal plain decoding's.
"""

from __future__ import annotations

import time

import numpy as np

from neffkit.contract import abi
from neffkit.contract.abi import GraphKey, Phase
from neffkit.contract.records import SpeculationRecord
from neffkit.runtime.config import smallest_fitting
from neffkit.runtime.worker.batch import DecodeBatch, PrefillBatch, SequenceState
from neffkit.runtime.worker.runner import GraphEntry, ModelRunner, padded_metadata
from neffkit.runtime.worker.step_output import StepOutput


class GraphProposer:
    """A proposer running graphs of its own bundle (a draft model, an MTP layer): their buckets,
    and what it did (calls and seconds, for `run --json`)."""

    def __init__(self, runner: ModelRunner, spec: SpeculationRecord) -> None:
        self.runner = runner
        self.k = spec.num_tokens
        config = runner.config
        self.batches = tuple(b for b in config.decode_buckets if b <= spec.max_batch)
        # catch-up runs the verify-shaped graphs, built only where 1 + K fits the context
        self.contexts = tuple(c for c in config.context_buckets if c > 1 + self.k)
        self.prefill_s = 0.0
        self.propose_s = 0.0
        self.calls = 0

    def buckets(self, seqs: list[SequenceState], counts: list[int]) -> tuple[int, int] | None:
        """(batch, context) for proposing `counts` tokens after each sequence, or None."""
        need = max(s.length + k - 1 for s, k in zip(seqs, counts, strict=True))
        context = smallest_fitting(self.contexts, need)
        batch = smallest_fitting(self.batches, len(seqs))
        return None if context is None or batch is None else (batch, context)

    def call(self, graph: GraphEntry, meta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls += 1
        return self.runner.execute(graph, meta)

    def propose(self, rows: list[SequenceState], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] greedy draft tokens for each row (rows asking for none run nothing)."""
        active = [i for i, k in enumerate(ks) if k > 0]
        drafts: list[list[int]] = [[] for _ in rows]
        seqs, counts = [rows[i] for i in active], [ks[i] for i in active]
        shape = self.buckets(seqs, counts) if active else None
        if shape is None:
            return drafts
        t0 = time.perf_counter()
        for i, proposed in zip(active, self.drafts(seqs, counts, *shape), strict=True):
            drafts[i] = proposed
        self.propose_s += time.perf_counter() - t0
        return drafts

    def drafts(
        self, seqs: list[SequenceState], counts: list[int], batch: int, context: int
    ) -> list[list[int]]:
        """counts[i] drafts for each sequence through the (batch, context) graphs."""
        raise NotImplementedError


class DraftModel(GraphProposer):
    """A draft model's graphs proposing greedily (the module docstring)."""

    def prefill(self, batch: PrefillBatch, out: StepOutput) -> None:
        """The target's prefill chunks, through the draft's graph of the same buckets."""
        t0 = time.perf_counter()
        self.runner.prefill(batch)
        for chunk in batch.chunks:
            state = chunk.seq.drafting
            state.computed, state.speculated = chunk.start + chunk.length, []
        self.prefill_s += time.perf_counter() - t0
        self.calls += 1

    def observe(self, batch: DecodeBatch, out: StepOutput) -> None:
        """A target decode or verify step: nothing to keep (the draft reads tokens only)."""

    def drafts(
        self, seqs: list[SequenceState], counts: list[int], batch: int, context: int
    ) -> list[list[int]]:
        tokens = [s.prompt_ids + s.output_ids for s in seqs]
        for seq, toks in zip(seqs, tokens, strict=True):
            _keep_verified(seq, toks)
        proposed = self._catch_up(seqs, tokens, batch, context)
        graph = self.runner.graphs[GraphKey(Phase.DECODE, batch, 1, context)]
        for step in range(1, max(counts)):  # draft `step` in, draft `step + 1` out
            meta = padded_metadata(graph.meta_specs)
            for row, (seq, k) in enumerate(zip(seqs, counts, strict=True)):
                if step < k:
                    pos = seq.length - 1 + step
                    fill_row(self.runner, meta, row, seq, [proposed[row][-1]], pos)
            out = self.call(graph, meta)[abi.NEXT_TOKENS]
            for row, k in enumerate(counts):
                if step < k:
                    proposed[row].append(int(out[row]))
        for row, (seq, k) in enumerate(zip(seqs, counts, strict=True)):
            seq.drafting.speculated = proposed[row][: k - 1]  # their K/V is in the cache
        return [p[:k] for p, k in zip(proposed, counts, strict=True)]

    def _catch_up(
        self, seqs: list[SequenceState], tokens: list[list[int]], batch: int, context: int
    ) -> list[list[int]]:
        """Feed each row the tokens its draft cache lacks (at least the last one), 1 + K at a
        time; the first draft is the greedy token after the last of them."""
        graph = self.runner.graphs[GraphKey(Phase.VERIFY, batch, 1 + self.k, context)]
        width = 1 + self.k
        first = [0] * len(seqs)
        while True:
            pending = [toks[s.drafting.computed :] for s, toks in zip(seqs, tokens, strict=True)]
            if not any(pending):
                return [[t] for t in first]
            meta = padded_metadata(graph.meta_specs)
            for row, (seq, todo) in enumerate(zip(seqs, pending, strict=True)):
                if todo:
                    fill_row(self.runner, meta, row, seq, todo[:width], seq.drafting.computed)
            out = self.call(graph, meta)[abi.NEXT_TOKENS]
            for row, (seq, todo) in enumerate(zip(seqs, pending, strict=True)):
                if todo:
                    n = min(len(todo), width)
                    first[row] = int(out[row, n - 1])
                    seq.drafting.computed += n


def fill_row(
    runner: ModelRunner,
    meta: dict[str, np.ndarray],
    row: int,
    seq: SequenceState,
    ids: list[int],
    at: int,
) -> None:
    """Row `row` feeds `ids` at positions from `at` (padding after them), sampled greedily."""
    bs = runner.config.block_size
    n, width = len(ids), meta[abi.INPUT_IDS].shape[1]
    positions = at + np.arange(width)
    blocks = np.asarray(seq.blocks, dtype=np.int64)
    meta[abi.INPUT_IDS][row, :n] = ids
    meta[abi.POSITIONS][row] = positions
    meta[abi.SLOT_MAPPING][row, :n] = abi.slots_of(blocks, positions[:n], bs)
    used = runner.config.blocks_for(at + n)
    meta[abi.BLOCK_TABLES][row, :used] = seq.blocks[:used]
    meta[abi.CONTEXT_LENS][row] = at + n
    meta[abi.TEMPERATURE][row] = 0.0  # greedy: a point-mass draft


def _keep_verified(seq: SequenceState, tokens: list[int]) -> None:
    """Count the draft tokens the target accepted since the last step as in the draft's cache
    (their K/V was written when they were proposed); the rest will be overwritten. The last
    token is always fed again: its output is the next first draft."""
    state = seq.drafting
    n = 0
    while (
        n < len(state.speculated)
        and state.computed + n < len(tokens) - 1
        and tokens[state.computed + n] == state.speculated[n]
    ):
        n += 1
    state.computed = min(state.computed + n, len(tokens) - 1)
    state.speculated = []
