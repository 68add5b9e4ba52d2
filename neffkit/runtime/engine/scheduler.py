"""Scheduling over fixed-shape graphs: admission, KV blocks, bucket choice, continuous batching.

Each step runs at most one prefill call and then one decode step. The prefill call packs the
next chunks of up to `prefill_batch` waiting prompts into one row of tokens (per-token sequence
ids; the smallest sequence, token and context buckets that fit; a prompt longer than the largest
token bucket runs as several chunks), so a burst of arrivals does not queue one prompt per step;
then one decode step over the running sequences (the smallest batch and context buckets that
fit, rows padded). Block 0 is the null block: padding slots land there, never handed out.

KV blocks are taken as they are needed (vLLM v1), in each KV group (group_blocks.py): a request
is admitted on its prompt's blocks (plus a watermark of free ones while others run; a sliding
group's only for the first chunk, then chunk by chunk), and each decode step gives a row the
blocks its tokens need, a sliding group giving back those behind the window first. When a block
cannot be had, a request is preempted by recompute (policy.py: which one, and what it keeps). A
request whose prompt + max_tokens would not fit the pool alone is refused when it is added.

Prefix caching (vLLM's semantics, kv_blocks.py): at admission a prompt takes the cached blocks of
its longest cached prefix and its prefill starts at the first uncached token; the last prompt
token is always computed. A request asking for prompt logprobs computes every position. Each
block is cached once all its tokens are in the cache, generated tokens included.

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
from neffkit.runtime.engine.group_blocks import GroupPools
from neffkit.runtime.engine.kv_blocks import BlockPool, extend_hashes
from neffkit.runtime.engine.limits import check_fits
from neffkit.runtime.engine.policy import WATERMARK, enqueue, rank, reset_for_recompute, victim
from neffkit.runtime.spec_decode.proposer import (
    BatchProposer,
    SpecCounters,
    method_proposer,
    per_row,
    record_outcome,
    verify_batch,
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
        self.kv = GroupPools(config.groups, config.block_size, config.prefix_caching)
        # slots of the device decode state, one per admitted request (its `last_tokens` entry)
        self.free_state_slots = list(range(config.layout.num_blocks - 1, 0, -1))
        # prompt tokens looked up in the prefix cache, and found (vLLM's prefix_cache_queries
        # and prefix_cache_hits)
        self.cache_queries = 0
        self.cache_hits = 0
        self.preemptions = 0  # vLLM's num_preemptions
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
    def allocator(self) -> BlockPool:
        """The first KV group's pool (the only one of most bundles)."""
        return self.kv.pools[0]

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

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
        passed: list[SequenceState] = []
        while self.waiting:
            seq = self.waiting[0]
            hits = self._cached_prefix(seq)
            start = len(hits[0]) * self.config.block_size if hits else 0
            end = start + self._chunk(seq, start, self.config.prefill_buckets[-1])
            need = self.kv.needs(hits, end, len(seq.prefill_ids))
            room = self.kv.peak_needs(hits, need, len(seq.prefill_ids), self.prefilling)
            if not self.free_state_slots or not self._room_for(seq, room, hits):
                break
            self.waiting.popleft()
            if not self._slot(seq):
                if not seq.finished:  # waits for a slot
                    passed.append(seq)
                continue
            self.kv.admit(seq, hits, need)
            seq.state_slot = self.free_state_slots.pop()
            seq.num_prefilled = start
            seq.num_registered = start // self.config.block_size
            if not seq.preemptions:  # what its response reports: the first admission's (vLLM)
                seq.num_cached = seq.num_prefilled
            if self._looks_up(seq):
                self.cache_queries += len(seq.prefill_ids)
                self.cache_hits += seq.num_prefilled
            self.prefilling.append(seq)
        self.waiting.extendleft(reversed(passed))

    def _room_for(self, seq: SequenceState, need: list[int], hits: list[list[int]]) -> bool:
        """Are `need` fresh blocks and the cached `hits` free for `seq` in every KV group,
        making room under the priority policy by preempting admitted requests ranked after
        it?"""
        while True:
            busy = bool(self.running or self.prefilling)
            if not self.kv.short(need, hits, WATERMARK if busy else 0.0):
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
        kept = []
        for seq in rows:
            if seq not in self.running:  # preempted for an earlier row
                continue
            end = self._step_end(seq)
            if self._take_blocks(seq, seq.length - 1, end, end):
                kept.append(seq)
        return [s for s in kept if s in self.running]

    def _take_blocks(
        self, seq: SequenceState, first: int, end: int, full_end: int, preempt: bool = True
    ) -> bool:
        """`seq`'s blocks for a step whose first query is at `first` and whose tokens end at
        `end` (a full group's at `full_end`), a sliding group's blocks behind the window given
        back first; short, it preempts (where `preempt`) or takes nothing. False: not taken."""
        self.kv.trim(seq, first)
        need = self.kv.needs(seq.kv_blocks, end, full_end)
        if self.kv.short(need) and (not preempt or not self._make_room(seq, need)):
            return False
        self.kv.grow(seq, need)
        return True

    def _make_room(self, seq: SequenceState, need: list[int]) -> bool:
        """Preempt (the policy's last admitted request first) until every group has `need`
        fresh blocks for `seq`; False if `seq` itself was preempted."""
        while self.kv.short(need):
            last = victim([*self.running, *self.prefilling], self.config.policy)
            assert last is not None  # seq itself is admitted
            self._preempt(last)
            if last is seq:
                return False
        return True

    def _step_end(self, seq: SequenceState) -> int:
        """The tokens a decode step writes up to: its last token, and with speculation the
        drafts after it (within its budget, which fits the pool)."""
        spec = self.config.speculation
        ahead = spec.num_tokens if spec is not None else 0
        return min(seq.length + ahead, len(seq.prompt_ids) + seq.max_tokens)

    def _chunk(self, seq: SequenceState, start: int, tokens: int) -> int:
        """The tokens of `seq`'s next prefill chunk from `start`: at most `tokens`, and no more
        than a sliding group's sequence can hold."""
        return self.kv.chunk_tokens(start, min(len(seq.prefill_ids) - start, tokens))

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

    def _cached_prefix(self, seq: SequenceState) -> list[list[int]]:
        """Each KV group's cached blocks the prompt can start from: full blocks before its last
        token (none: no lookup)."""
        if not self._looks_up(seq):
            return []
        bs, tokens = self.config.block_size, seq.prefill_ids
        extend_hashes(seq.block_hashes, tokens, bs, seq.adapter_key)
        return self.kv.cached_prefix(seq.block_hashes[: (len(tokens) - 1) // bs])

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
            self.kv.register(seq, i, seq.block_hashes[i])
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
            if seq not in self.prefilling:  # preempted to make room for an earlier chunk
                continue
            start = seq.num_prefilled
            n = self._chunk(seq, start, budget)
            # a sliding group's blocks for the chunk (a full group took the prompt's at
            # admission); only the call's first chunk preempts for them, a later one waits
            if n == 0 or not self._take_blocks(
                seq, start, start + n, len(seq.prefill_ids), not chunks
            ):
                break
            chunks.append(PrefillChunk(seq, start, n))
            budget -= n
        if not chunks:
            return None
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
            pooled = out.arrays.get(abi.POOLED)
            if pooled is not None:  # an embed bundle: the chunk's pooled states
                seq.pool(pooled[row], chunk.start, self.config.layout.pooling)
            seq.num_prefilled += chunk.length
            self._register(seq, seq.num_prefilled)
            if seq.num_prefilled < len(seq.prefill_ids):
                continue
            self.prefilling.remove(seq)
            done.append(seq)
            if seq.pooled is not None:
                seq.embedding = seq.pooled.result(len(seq.prompt_ids))
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
        spec, proposer = self.config.speculation, self.proposer
        verify = (
            None
            if spec is None or proposer is None
            else verify_batch(spec, proposer, self.config, rows)
        )
        if verify is not None:
            return verify
        batch = smallest_fitting(self.config.decode_buckets, len(rows))
        context = smallest_fitting(self.config.context_buckets, max(s.length for s in rows))
        assert batch is not None and context is not None
        return DecodeBatch(rows, batch, context)

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
        seq.append(token, out, row, self.config.eos_token_ids, position)
        if seq.finished:
            self._release(seq)

    def _release(self, seq: SequenceState) -> None:
        for queue in (self.waiting, self.prefilling):
            if seq in queue:
                queue.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq.kv_blocks:
            self.kv.release(seq)  # the tail evicted before the shared head
        if seq.state_slot:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = 0
        if self.adapters is not None:
            self.adapters.release(seq)
