"""Scheduling over fixed-shape graphs: admission, KV blocks, bucket choice, continuous batching.

Each step runs at most one prefill call and then one decode step. The prefill call packs the
next chunks of up to `prefill_batch` waiting prompts into one row of tokens (per-token sequence
ids; the smallest sequence, token and context buckets that fit; prompts longer than the largest
token bucket run as several chunks), so a burst of arrivals does not queue one prompt per step;
then one decode step over the running
sequences (the smallest batch and context buckets that fit, rows padded). Block 0 is the null
block: padding slots and -1 block-table entries land there, so it is never handed out.

KV blocks are taken as they are needed (vLLM v1): a request is admitted on its prompt's blocks
(plus a watermark of free ones while others run), and each decode step gives a row the block its
next token (and drafts) need. When a step's block cannot be had, a running request is preempted
by recompute (policy.py: which one, and what it keeps). A request whose prompt + max_tokens
would not fit the whole pool alone is refused when it is added, so every admitted request can
finish.

Prefix caching (vLLM's semantics, kv_blocks.py): at admission a prompt takes the cached blocks of
its longest cached prefix and its prefill starts at the first uncached token; the last prompt
token is always computed, so the first sampled token comes from a graph. A request asking for
prompt logprobs computes every position. Each block is cached once all its tokens are in the
cache (after a prefill chunk or a decode step), generated tokens included.

Pure Python (and numpy), no graphs: the runner (runner.py) turns what is scheduled here into
metadata, and the scheduler's tests run against a fake runner in milliseconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

from neffkit.contract import abi
from neffkit.errors import NeffkitError
from neffkit.runtime.config import SchedulerConfig, smallest_fitting
from neffkit.runtime.engine.kv_blocks import BlockPool, extend_hashes
from neffkit.runtime.engine.limits import check_fits
from neffkit.runtime.engine.policy import WATERMARK, enqueue, rank, reset_for_recompute, victim
from neffkit.runtime.spec_decode.proposer import (
    BatchProposer,
    SpecCounters,
    draft_count,
    method_proposer,
    per_row,
    record_outcome,
    verify_batch_size,
)
from neffkit.runtime.worker.batch import DecodeBatch, PrefillBatch, PrefillChunk, SequenceState
from neffkit.runtime.worker.step_output import StepOutput


class AdapterPool(Protocol):
    """The adapter slots requests take at admission (engine/adapters.py)."""

    def acquire(self, seq: SequenceState) -> bool: ...

    def release(self, seq: SequenceState) -> None: ...


class Scheduler:
    """Queues and KV blocks. Not thread-safe: one caller drives it (the engine core)."""

    def __init__(self, config: SchedulerConfig, adapters: AdapterPool | None = None) -> None:
        self.config = config
        self.adapters = adapters  # the adapters' slots (bundles with `lora:`)
        self.allocator = BlockPool(config.num_blocks, config.prefix_caching)
        # prompt tokens looked up in the prefix cache, and found (vLLM's prefix_cache_queries
        # and prefix_cache_hits)
        self.cache_queries = 0
        self.cache_hits = 0
        self.preemptions = 0  # vLLM's num_preemptions
        self.watermark = max(1, int(WATERMARK * self.allocator.num_usable))
        self.spec = SpecCounters()
        # prompt lookup's; a draft model's is set by the engine, which holds its graphs
        spec = config.speculation
        self.proposer: BatchProposer | None = (
            per_row(method_proposer(spec)) if spec and spec.method == "ngram" else None
        )
        self.waiting: deque[SequenceState] = deque()
        self.prefilling: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []

    def add(self, seq: SequenceState) -> None:
        check_fits(self.config, seq.prompt_ids, seq.params)
        enqueue(self.waiting, seq, self.config.policy)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.allocator.num_free / self.allocator.num_usable

    @property
    def num_waiting(self) -> int:
        """Requests not yet decoding (waiting for blocks, or prefilling)."""
        return len(self.waiting) + len(self.prefilling)

    def abort(self, seq: SequenceState, reason: str = "abort") -> None:
        """End a request wherever it is and free its blocks (client went away, stop string)."""
        if seq.finished:
            return
        seq.finish_reason = reason
        self._release(seq)

    def admit(self) -> None:
        """Waiting requests, in the policy's order, whose prompt's blocks are free (beside
        running requests, with the watermark left over); under the priority policy one that
        does not fit preempts running requests ranked after it. One whose adapter finds no free
        slot waits, and those behind it go on."""
        pool = self.allocator
        passed: list[SequenceState] = []
        while self.waiting:
            seq = self.waiting[0]
            hits = self._cached_prefix(seq)
            need = self.config.blocks_for(len(seq.prefill_ids))
            if not self._room_for(seq, need, hits):
                break
            self.waiting.popleft()
            if not self._slot(seq):
                if not seq.finished:  # waits for a slot
                    passed.append(seq)
                continue
            pool.take(hits)
            seq.blocks = hits + pool.allocate(need - len(hits))
            seq.num_prefilled = len(hits) * self.config.block_size
            seq.num_registered = len(hits)
            if not seq.preemptions:  # what its response reports: the first admission's (vLLM)
                seq.num_cached = seq.num_prefilled
            if self._looks_up(seq):
                self.cache_queries += len(seq.prefill_ids)
                self.cache_hits += seq.num_prefilled
            self.prefilling.append(seq)
        self.waiting.extendleft(reversed(passed))

    def _room_for(self, seq: SequenceState, need: int, hits: list[int]) -> bool:
        """Are `need` blocks (`hits` of them cached) free for `seq`, making room under the
        priority policy by preempting admitted requests ranked after it?"""
        pool = self.allocator
        while True:
            busy = bool(self.running or self.prefilling)
            short = need - len(hits) + pool.free_among(hits) - pool.num_free
            if short + (self.watermark if busy else 0) <= 0:
                return True
            if self.config.policy != "priority":
                return False
            key = rank(seq, "priority")
            after = [s for s in (*self.running, *self.prefilling) if rank(s, "priority") > key]
            last = victim(after, "priority")
            if last is None:
                return False
            self._preempt(last)

    def _preempt(self, seq: SequenceState) -> None:
        """Take an admitted request's blocks back; it waits to recompute (policy.py)."""
        self._release(seq)
        reset_for_recompute(seq)
        self.preemptions += 1
        enqueue(self.waiting, seq, self.config.policy)

    def _grow(self, rows: list[SequenceState]) -> list[SequenceState]:
        """Each row's blocks for this step's tokens, preempting (the policy's last admitted
        request first, maybe a row itself) while the pool is short; the rows left."""
        pool, kept = self.allocator, []
        for seq in rows:
            if seq not in self.running:  # preempted for an earlier row
                continue
            need = self._step_blocks(seq) - len(seq.blocks)
            while need > pool.num_free:
                last = victim([*self.running, *self.prefilling], self.config.policy)
                assert last is not None  # seq itself is running
                self._preempt(last)
                if last is seq:
                    break
            if seq in self.running:
                if need > 0:
                    seq.blocks += pool.allocate(need)
                kept.append(seq)
        return [s for s in kept if s in self.running]

    def _step_blocks(self, seq: SequenceState) -> int:
        """Blocks a decode step needs a row to hold: its last token's position, and with
        speculation the drafts' after it (within its budget, which fits the pool)."""
        spec = self.config.speculation
        ahead = spec.num_tokens if spec is not None else 0
        budget = len(seq.prompt_ids) + seq.max_tokens
        return self.config.blocks_for(min(seq.length + ahead, budget))

    def _slot(self, seq: SequenceState) -> bool:
        """The request's adapter in a slot (True: it has none, or it got one). An adapter that
        can no longer be read ends its request with "error" (False, never admitted)."""
        if seq.adapter_key is None or seq.lora_slot or self.adapters is None:
            return True
        try:
            return self.adapters.acquire(seq)
        except NeffkitError:
            seq.finish_reason = "error"
            return False

    def _looks_up(self, seq: SequenceState) -> bool:
        return self.config.prefix_caching and seq.params.prompt_logprobs is None

    def _cached_prefix(self, seq: SequenceState) -> list[int]:
        """The cached blocks the prompt can start from: full blocks before its last token."""
        if not self._looks_up(seq):
            return []
        bs, tokens = self.config.block_size, seq.prefill_ids
        extend_hashes(seq.block_hashes, tokens, bs, seq.adapter_key)
        return self.allocator.lookup(seq.block_hashes[: (len(tokens) - 1) // bs])

    def _register(self, seq: SequenceState, computed: int, pending: Sequence[int] = ()) -> None:
        """Cache the blocks whose tokens are all in the cache now (`computed` tokens: the
        sequence's, then `pending` ones a verify step accepted but has not appended yet)."""
        bs = self.config.block_size
        spec = self.config.speculation
        if spec is not None and spec.method != "ngram":  # cached blocks hold the draft's K/V too
            computed = min(computed, seq.drafting.computed)
        full = computed // bs
        if not self.config.prefix_caching or full <= seq.num_registered:
            return
        tokens = seq.prompt_ids
        if computed > len(tokens):
            tokens = tokens + seq.output_ids + list(pending)
        extend_hashes(seq.block_hashes, tokens[:computed], bs, seq.adapter_key)
        for i in range(seq.num_registered, full):
            self.allocator.register(seq.blocks[i], seq.block_hashes[i])
        seq.num_registered = full

    def next_prefill(self) -> PrefillBatch | None:
        """The prefilling prompts' next chunks, packed into one call: the first prompt's chunk
        (up to the largest token bucket), then the prompts behind it while tokens remain in that
        bucket and rows in the largest prefill_batch bucket. A prompt asking for prompt logprobs
        prefills alone (only one-sequence graphs return them)."""
        if not self.prefilling:
            return None
        lay = self.config
        budget = lay.prefill_buckets[-1]
        head = self.prefilling[0]
        seqs = [head]
        if head.params.prompt_logprobs is None:
            seqs += [s for s in list(self.prefilling)[1:] if s.params.prompt_logprobs is None]
        chunks: list[PrefillChunk] = []
        for seq in seqs[: lay.prefill_batch[-1]]:
            n = min(len(seq.prefill_ids) - seq.num_prefilled, budget)
            if n == 0:
                break
            chunks.append(PrefillChunk(seq, seq.num_prefilled, n))
            budget -= n
        tokens = smallest_fitting(lay.prefill_buckets, sum(c.length for c in chunks))
        batch = smallest_fitting(lay.prefill_batch, len(chunks))
        assert tokens is not None and batch is not None
        need = max(max(c.start + c.length for c in chunks), tokens)
        context = smallest_fitting(lay.context_buckets, need)
        assert context is not None  # check_fits bounded the prompts
        return PrefillBatch(chunks, batch, tokens, context)

    def prefilled(self, batch: PrefillBatch, out: StepOutput) -> list[SequenceState]:
        """After a prefill call: each sequence decodes once its whole prompt is in the cache."""
        done = []
        for row, chunk in enumerate(batch.chunks):
            seq = chunk.seq
            top = seq.params.prompt_logprobs
            if top is not None and not seq.output_ids:  # p scores prompt token p + 1 (one row)
                last = min(chunk.length, len(seq.prompt_ids) - 1 - chunk.start)
                seq.prompt_logprobs += out.prompt_logprobs(range(0, last), top)
            seq.num_prefilled += chunk.length
            self._register(seq, seq.num_prefilled)
            if seq.num_prefilled < len(seq.prefill_ids):
                continue
            self.prefilling.remove(seq)
            done.append(seq)
            if seq.params.max_tokens == 0:  # echo / prompt logprobs only: nothing generated
                seq.finish_reason = "length"
                self._release(seq)
                continue
            self.running.append(seq)
            self._append(seq, out, row)
        return done

    def next_decode(self) -> DecodeBatch | None:
        if not self.running:
            return None
        largest = self.config.decode_buckets[-1]
        rows = self.running[:largest]
        if len(self.running) > largest:
            # Rotate so that more sequences than the largest bucket all make progress.
            self.running = self.running[largest:] + rows
        rows = self._grow(rows)
        if not rows:
            return None
        verify = self._verify_batch(rows)
        if verify is not None:
            return verify
        batch = smallest_fitting(self.config.decode_buckets, len(rows))
        context = smallest_fitting(self.config.context_buckets, max(s.length for s in rows))
        assert batch is not None and context is not None
        return DecodeBatch(rows, batch, context)

    def _verify_batch(self, rows: list[SequenceState]) -> DecodeBatch | None:
        """The rows' drafts in a verify graph, where the bundle has one that fits and some row
        proposes; else None (plain decode)."""
        spec, proposer = self.config.speculation, self.proposer
        if spec is None or proposer is None:
            return None
        batch = verify_batch_size(spec, self.config.decode_buckets, len(rows))
        if batch is None:
            return None
        ks = [
            draft_count(spec, s.max_tokens - len(s.output_ids) - 1, s.drafting)
            if s.may_draft
            else 0
            for s in rows
        ]
        drafts = proposer(rows, ks) if any(ks) else []
        if not any(drafts):
            return None
        need = max(s.length + len(d) for s, d in zip(rows, drafts, strict=True))
        context = smallest_fitting(self.config.context_buckets, need)
        if context is None or 1 + spec.num_tokens >= context:
            return None
        return DecodeBatch(rows, batch, context, drafts)

    def decoded(self, batch: DecodeBatch, out: StepOutput) -> list[SequenceState]:
        if batch.drafts is not None:
            return self._verified(batch, out)
        for row, seq in enumerate(batch.rows):  # padding rows last
            self._register(seq, seq.length)  # this step wrote the K/V of its last token
            self._append(seq, out, row)
        return batch.rows

    def _verified(self, batch: DecodeBatch, out: StepOutput) -> list[SequenceState]:
        """Each row's emitted tokens (accepted drafts, then the one sampled after them), one at a
        time, so EOS, stop tokens and max_tokens end a run where they fall."""
        assert batch.drafts is not None
        emitted = out.arrays[abi.NUM_EMITTED]
        sampled = out.arrays[abi.NEXT_TOKENS]
        for row, (seq, drafts) in enumerate(zip(batch.rows, batch.drafts, strict=True)):
            n = int(emitted[row])
            accepted = n - 1
            self.spec.count(len(drafts), accepted)
            record_outcome(seq.drafting, len(drafts), accepted)
            self._register(seq, seq.length + accepted, drafts[:accepted])
            for i in range(n):
                self._append(seq, out, row, int(sampled[row, i]), i)
                if seq.finished:
                    break
        return batch.rows

    def _append(
        self,
        seq: SequenceState,
        out: StepOutput,
        row: int,
        token: int | None = None,
        position: int | None = None,
    ) -> None:
        """Add a sampled token (a verify step's: `token`, at `position` of its row)."""
        token = out.tokens[row] if token is None else token
        seq.output_ids.append(token)
        params = seq.params
        if seq.penalties is not None:
            seq.penalties.add(token)
        if seq.grammar is not None:
            if not seq.grammar.consume_token(token):
                seq.finish_reason = "error"  # the graph sampled what the mask forbade
            elif seq.grammar.is_stopped():  # complete, nothing may follow: done, EOS or not
                seq.finish_reason = "stop"
            if seq.finished:
                self._release(seq)
                return
        if params.logprobs is not None:
            seq.output_logprobs.append(out.logprobs(row, params.logprobs, position))
        if not params.ignore_eos and token in self.config.eos_token_ids:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= seq.max_tokens:
            seq.finish_reason = "length"
        if seq.finished:
            self._release(seq)

    def _release(self, seq: SequenceState) -> None:
        for queue in (self.waiting, self.prefilling):
            if seq in queue:
                queue.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq.blocks:
            self.allocator.free(seq.blocks[::-1])  # the tail evicted before the shared head
            seq.blocks = []
        if self.adapters is not None:
            self.adapters.release(seq)
