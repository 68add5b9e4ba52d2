"""DeepSeek-V3's multi-token prediction layer as the proposer (speculation.method: mtp).

The MTP layer is built as a one-layer bundle inside the target's (`draft/`, like a draft model),
with a latent cache of the target's blocks. Position p of the layer reads token p + 1 and the
target's hidden state at p (the one token p + 1 was predicted from), so it runs a step behind
the target: the target's graphs return their hidden states, which this proposer keeps per
sequence until the layer has consumed them. After the target's prefill it consumes the prompt
(the last position with the token the prefill sampled) and holds the first draft; each verify
step it first catches up on the positions the target computed since (the accepted drafts, or
the tokens of plain steps it sat out), 1 + K at a time through its verify-shaped graph, then
proposes K - 1 more greedily from its own output hidden state (vLLM's MTP/EAGLE recurrence),
writing K/V the next catch-up overwrites. Greedy drafts are point masses: outputs equal plain
decoding's.
"""

from __future__ import annotations

import time

import numpy as np

from neffkit.contract import abi
from neffkit.contract.abi import GraphKey, Phase
from neffkit.runtime.spec_decode.draft import GraphProposer, fill_row
from neffkit.runtime.worker.batch import DecodeBatch, PrefillBatch, SequenceState
from neffkit.runtime.worker.runner import GraphEntry, padded_metadata
from neffkit.runtime.worker.step_output import StepOutput

# catch-up calls' worth of the target's hidden states a row may keep while it decodes plainly
# (above max_batch, or backing off): past it the row stops drafting and keeps none (catching up
# would cost as many MTP calls, and the states are a hidden size of float32 each)
PENDING_STEPS = 64


class MtpProposer(GraphProposer):
    """The MTP layer's graphs proposing greedily (the module docstring)."""

    def prefill(self, batch: PrefillBatch, out: StepOutput) -> None:
        """Consume the chunks' positions: token p + 1 (the sampled token after a prompt's last)
        with the target's hidden state at p, in the same packed row."""
        t0 = time.perf_counter()
        graph, meta = self.runner.prefill_metadata(batch)
        hidden = out.arrays[abi.HIDDEN_STATES]  # [T, H]
        at = 0
        for i, chunk in enumerate(batch.chunks):
            seq, start, n = chunk.seq, chunk.start, chunk.length
            following = seq.prefill_ids[start + 1 : start + n + 1]
            if len(following) < n:  # the prompt's last position: the token just sampled
                following = [*following, out.tokens[i]]
            meta[abi.INPUT_IDS][0, at : at + n] = following
            meta[abi.PREVIOUS_HIDDEN][0, at : at + n] = hidden[at : at + n]
            at += n
        result = self.call(graph, meta)
        tokens, mtp_hidden = result[abi.NEXT_TOKENS], result[abi.HIDDEN_STATES]
        at = 0
        for i, chunk in enumerate(batch.chunks):
            state, end = chunk.seq.drafting, chunk.start + chunk.length
            state.computed, state.hidden = end, []
            if end == len(chunk.seq.prefill_ids):
                state.head = (int(tokens[i]), mtp_hidden[at + chunk.length - 1].copy())
            at += chunk.length
        self.prefill_s += time.perf_counter() - t0

    def observe(self, batch: DecodeBatch, out: StepOutput) -> None:
        """Keep the target's hidden states at the positions its step computed for good: the
        row's input token, and the accepted drafts of a verify step (PENDING_STEPS bounds
        them)."""
        hidden = out.arrays[abi.HIDDEN_STATES]  # decode [B, H]; verify [B, T, H]
        emitted = out.arrays.get(abi.NUM_EMITTED)
        for row, seq in enumerate(batch.rows):
            state = seq.drafting
            if state.stopped:
                continue
            if emitted is None:  # copies: an executor may reuse its output buffers
                state.hidden.append(hidden[row].copy())
            else:
                state.hidden.extend(hidden[row, : int(emitted[row])].copy())
            if len(state.hidden) > PENDING_STEPS * (1 + self.k):  # too far behind: plain
                state.hidden, state.stopped = [], True

    def drafts(
        self, seqs: list[SequenceState], counts: list[int], batch: int, context: int
    ) -> list[list[int]]:
        self._catch_up(seqs, batch, context)
        proposed = [[seq.drafting.head[0]] for seq in seqs]  # type: ignore[index]
        states = [seq.drafting.head[1] for seq in seqs]  # type: ignore[index]
        graph = self.runner.graphs[GraphKey(Phase.DECODE, batch, 1, context)]
        for step in range(1, max(counts)):  # draft `step` in at position L - 2 + step
            meta = _metadata(graph)
            for row, (seq, k) in enumerate(zip(seqs, counts, strict=True)):
                if step < k:
                    at = seq.length - 2 + step
                    fill_row(self.runner, meta, row, seq, [proposed[row][-1]], at)
                    meta[abi.PREVIOUS_HIDDEN][row, 0] = states[row]
            out = self.call(graph, meta)
            for row, k in enumerate(counts):
                if step < k:
                    proposed[row].append(int(out[abi.NEXT_TOKENS][row]))
                    states[row] = out[abi.HIDDEN_STATES][row].copy()
        return [p[:k] for p, k in zip(proposed, counts, strict=True)]

    def _catch_up(self, seqs: list[SequenceState], batch: int, context: int) -> None:
        """Feed each row the positions the target computed since the layer last ran (token
        p + 1 with the target's hidden state at p), 1 + K at a time; the layer's output at the
        last of them is the row's first draft and the state its next steps start from."""
        graph = self.runner.graphs[GraphKey(Phase.VERIFY, batch, 1 + self.k, context)]
        width = 1 + self.k
        while any(seq.drafting.hidden for seq in seqs):
            meta = _metadata(graph)
            fed = [0] * len(seqs)
            for row, seq in enumerate(seqs):
                state = seq.drafting
                n = min(len(state.hidden), width)
                if n:
                    p = state.computed
                    following = (seq.prompt_ids + seq.output_ids)[p + 1 : p + 1 + n]
                    fill_row(self.runner, meta, row, seq, following, p)
                    meta[abi.PREVIOUS_HIDDEN][row, :n] = np.stack(state.hidden[:n])
                    fed[row] = n
            out = self.call(graph, meta)
            for row, (seq, n) in enumerate(zip(seqs, fed, strict=True)):
                if n:
                    state = seq.drafting
                    token, hidden = out[abi.NEXT_TOKENS][row, n - 1], out[abi.HIDDEN_STATES]
                    state.head = (int(token), hidden[row, n - 1].copy())
                    state.computed += n
                    del state.hidden[:n]


def _metadata(graph: GraphEntry) -> dict[str, np.ndarray]:
    return padded_metadata(graph.meta_specs)
