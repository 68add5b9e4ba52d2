"""Speculative decoding on the host: which rows speculate, their drafts, and the counts.

Each step the running rows either decode one token each or, where the bundle has verify graphs
(manifest `speculation`), run one verify graph: each row's last token and up to K drafts, every
position sampled in the graph and the drafts accepted while they match (models/decoder.py), so
a row emits 1 to K + 1 tokens and its outputs equal plain decoding's, seeded sampling included.
A row proposes at most what its budget allows (max_tokens), a batch past max_batch or past the
largest context bucket decodes plainly (vllm-neuron's `max_model_len - K` cutoff), and a row
whose drafts keep being rejected stops proposing for a while (back-off), so text that does not
repeat itself pays for few verify steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from neffkit.contract.records import SpeculationRecord
from neffkit.runtime.config import SchedulerConfig, smallest_fitting
from neffkit.runtime.spec_decode.ngram import propose
from neffkit.runtime.worker.batch import DecodeBatch, DraftState, SequenceState

# a row whose drafts were all rejected this many verify steps in a row proposes nothing for the
# next BACKOFF_STEPS steps (then tries again)
MISSES_BEFORE_BACKOFF = 3
BACKOFF_STEPS = 16

# (the sequence's tokens, at most k) → draft tokens; the method's, or one a caller supplies
Proposer = Callable[[list[int], int], list[int]]
# (the rows, at most k each) → each row's drafts: a draft model proposes for a batch at once
# (rows are the scheduler's SequenceStates)
BatchProposer = Callable[[list[Any], list[int]], list[list[int]]]


def method_proposer(spec: SpeculationRecord) -> Proposer:
    """The bundle's proposer: prompt lookup with its n-gram bounds."""
    return lambda tokens, k: propose(tokens, k, spec.prompt_lookup_min, spec.prompt_lookup_max)


def per_row(proposer: Proposer) -> BatchProposer:
    """A proposer of one sequence at a time, over a batch."""

    def batch(rows: list[Any], ks: list[int]) -> list[list[int]]:
        return [
            proposer(s.prompt_ids + s.output_ids, k)[:k] if k > 0 else []
            for s, k in zip(rows, ks, strict=True)
        ]

    return batch


@dataclass
class SpecCounters:
    """vLLM's spec-decode metrics: drafts (rows that proposed), draft tokens, accepted tokens,
    and accepted tokens by draft position."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculating row emits per verify step (accepted + the one sampled)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    def count(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        while len(self.accepted_per_position) < proposed:
            self.accepted_per_position.append(0)
        for i in range(accepted):
            self.accepted_per_position[i] += 1


def draft_count(spec: SpeculationRecord, budget: int, state: DraftState) -> int:
    """How many drafts a row may propose: at most K and at most `budget` (tokens it may still
    emit, less one); none while it backs off, or after its proposer stopped it."""
    if state.stopped:
        return 0
    if state.paused > 0:
        state.paused -= 1
        return 0
    return max(0, min(spec.num_tokens, budget))


def record_outcome(state: DraftState, proposed: int, accepted: int) -> None:
    """Back off a row whose drafts keep failing."""
    if not proposed:
        return
    state.misses = 0 if accepted else state.misses + 1
    if state.misses >= MISSES_BEFORE_BACKOFF:
        state.misses, state.paused = 0, BACKOFF_STEPS


def verify_batch_size(
    spec: SpeculationRecord, decode_buckets: tuple[int, ...], rows: int
) -> int | None:
    """The verify graph's rows for `rows` sequences, or None (more than max_batch)."""
    return smallest_fitting([b for b in decode_buckets if b <= spec.max_batch], rows)


def verify_batch(
    spec: SpeculationRecord,
    proposer: BatchProposer,
    config: SchedulerConfig,
    seqs: list[SequenceState],
) -> DecodeBatch | None:
    """The rows' drafts in a verify graph, where the bundle has one that fits and some row
    proposes; else None (plain decode)."""
    batch = verify_batch_size(spec, config.decode_buckets, len(seqs))
    if batch is None:
        return None
    ks = [
        draft_count(spec, s.max_tokens - len(s.output_ids) - 1, s.drafting) if s.may_draft else 0
        for s in seqs
    ]
    drafts = proposer(seqs, ks) if any(ks) else []
    if not any(drafts):
        return None
    need = max(s.length + len(d) for s, d in zip(seqs, drafts, strict=True))
    context = smallest_fitting(config.context_buckets, need)
    if context is None or 1 + spec.num_tokens >= context:
        return None
    return DecodeBatch(seqs, batch, context, drafts)
