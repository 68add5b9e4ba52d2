"""Who goes first and who gives way when KV blocks run short, under vLLM's two scheduling
policies (`--scheduling-policy`):

- fcfs: requests wait in arrival order; the latest arrival is preempted first;
- priority: by the request's `priority` (lower first), ties by arrival; the request with the
  largest value (the latest of those) is preempted first, and an arrival may preempt running
  requests ranked after it.

A preempted request gives back its blocks and goes back to the waiting queue to recompute: its
prompt and the tokens generated so far prefill again (the blocks it had registered in the
prefix cache stay cached, so most of that is a cache hit) and it goes on from there. Its sampler
state stays with it (seed, penalty counts, grammar), so its outputs do not change (vLLM v1's
preemption by recompute).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from neffkit.runtime.worker.batch import DraftState, SequenceState

# blocks kept free when admitting beside running requests: room for their next tokens, so an
# admission does not preempt at the next step (vLLM's watermark: 1% of the blocks)
WATERMARK = 0.01


def rank(seq: SequenceState, policy: str) -> tuple[int, int]:
    """Sort key: lower goes first and is preempted last."""
    return (seq.priority if policy == "priority" else 0, seq.request_id)


def enqueue(waiting: deque[SequenceState], seq: SequenceState, policy: str) -> None:
    """Put `seq` in the waiting queue in rank order: an arrival goes last under fcfs, and a
    preempted request goes back before those that arrived after it."""
    key = rank(seq, policy)
    for i, other in enumerate(waiting):
        if rank(other, policy) > key:
            waiting.insert(i, seq)
            return
    waiting.append(seq)


def victim(candidates: Iterable[SequenceState], policy: str) -> SequenceState | None:
    """The request that gives way: ranked last."""
    return max(candidates, key=lambda s: rank(s, policy), default=None)


def reset_for_recompute(seq: SequenceState) -> None:
    """A preempted request, its blocks given back, as it waits again: nothing computed. Prompt
    logprobs already sent stay sent (a request with outputs does not collect them again); those
    of a prompt still prefilling are collected afresh."""
    seq.num_prefilled = seq.num_registered = 0  # num_cached: its first admission's, reported
    seq.drafting = DraftState()  # a draft model's cache lived in the same blocks
    seq.pooled = None  # an embedding's chunks are pooled afresh
    if not seq.output_ids:
        seq.prompt_logprobs = []
    seq.preemptions += 1
