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

from neffkit.contract.records import SpeculationRecord
from neffkit.runtime.limits import smallest_fitting
from neffkit.runtime.ngram import propose

# a row whose drafts were all rejected this many verify steps in a row proposes nothing for the
# next BACKOFF_STEPS steps (then tries again)
MISSES_BEFORE_BACKOFF = 3
BACKOFF_STEPS = 16

# (the sequence's tokens, at most k) → draft tokens; the method's, or one a caller supplies
Proposer = Callable[[list[int], int], list[int]]


def method_proposer(spec: SpeculationRecord) -> Proposer:
    """The bundle's proposer: prompt lookup with its n-gram bounds."""
    return lambda tokens, k: propose(tokens, k, spec.prompt_lookup_min, spec.prompt_lookup_max)


@dataclass
class DraftState:
    """A sequence's speculation history: consecutive all-rejected steps and a pause."""

    misses: int = 0
    paused: int = 0


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


def drafts_for(
    spec: SpeculationRecord, proposer: Proposer, tokens: list[int], budget: int, state: DraftState
) -> list[int]:
    """A row's drafts: at most K and at most `budget` (tokens it may still emit, less one)."""
    if state.paused > 0:
        state.paused -= 1
        return []
    k = min(spec.num_tokens, budget)
    return proposer(tokens, k)[:k] if k > 0 else []


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
