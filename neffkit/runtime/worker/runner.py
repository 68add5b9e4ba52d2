"""One rank's graphs and their metadata: what the scheduler decided in, sampled tokens out.

The runner owns a rank's graph entries (each an executor's `run(metadata) → outputs`), builds each
step's metadata with numpy (the decode graphs' arrays are allocated once and updated in place),
and times the graph calls. It is all a follower rank needs: followers receive (graph index,
metadata) from rank 0 and call `execute`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from neffkit.contract import abi
from neffkit.contract.abi import GraphKey, Phase
from neffkit.contract.kv_groups import group_input, is_group_input
from neffkit.runtime.config import SchedulerConfig
from neffkit.runtime.worker.batch import DecodeBatch, PrefillBatch, SequenceState
from neffkit.runtime.worker.logit_inputs import MaskFiller, fill_bitmasks, write_row
from neffkit.runtime.worker.step_output import StepOutput

# metadata arrays in the graph's input order → its user outputs in order (next tokens first);
# the executor binds the rest
Executable = Callable[[list[np.ndarray]], list[np.ndarray]]
# called with (graph index, metadata) before every graph call: the multi-rank broadcast
OnRun = Callable[[int, dict[str, np.ndarray]], None]


class DraftProposer(Protocol):
    """A draft model's (or MTP layer's) graphs (spec_decode/), as the runner holds them and the
    engine calls them."""

    calls: int  # graph calls
    prefill_s: float
    propose_s: float

    def prefill(self, batch: PrefillBatch, out: StepOutput) -> None: ...

    def observe(self, batch: DecodeBatch, out: StepOutput) -> None: ...

    def propose(self, rows: list[SequenceState], ks: list[int]) -> list[list[int]]: ...


@dataclass(frozen=True)
class GraphEntry:
    """One compiled graph as the runner sees it: its bucket and its metadata input order."""

    name: str
    key: abi.GraphKey  # phase and static dims: how the scheduler's choice finds it
    meta_specs: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) in input order
    run: Executable
    outputs: tuple[str, ...] = (abi.NEXT_TOKENS,)  # names of what `run` returns, in order

    @property
    def rows(self) -> int:
        return self.key.rows

    @property
    def meta_inputs(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.meta_specs)


@dataclass
class Timings:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    prefill_chunks: int = 0  # prefill graph calls (each packs one chunk per row)
    # bytes of the decode metadata arrays a step rewrote: what an executor that keeps the
    # metadata on the device must send it (the arrays a step leaves alone stay there)
    decode_meta_bytes: int = 0
    verify_steps: int = 0  # decode steps that ran a verify graph (speculation)


class DecodeBuffers:
    """One decode graph's metadata arrays, allocated once and updated in place every step.

    A decode step changes few values per row (token, position, slot, length); the block table
    row changes when a sequence enters a new block and the sampling values (and, with device
    state, `seq_slots`) when a row gets another sequence. Passing the same arrays every step also
    lets the executor bind them to the graph once (it compares the arrays it is given with the
    last call's). Keeps the host's share of a demo-model decode step small. `fill` returns the
    bytes of the arrays it rewrote (Timings.decode_meta_bytes).
    """

    PER_STEP = (abi.POSITIONS, abi.SLOT_MAPPING, abi.CONTEXT_LENS)  # rewritten every step
    PER_ROW = (abi.BLOCK_TABLES, abi.SEQ_SLOTS, *abi.SAMPLING_NAMES, abi.LORA_SLOTS)

    def __init__(
        self, graph: GraphEntry, block_size: int, eos_token_ids: tuple[int, ...] = ()
    ) -> None:
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.meta = padded_metadata(graph.meta_specs)
        m = self.meta
        # host state: the last sampled token is sent; device state: the graph reads it from
        # `last_tokens[seq_slots[row]]`
        self.ids, self.seq_slots = m.get(abi.INPUT_IDS), m.get(abi.SEQ_SLOTS)
        self.pos, self.lens = m[abi.POSITIONS], m[abi.CONTEXT_LENS]
        # each KV group's slot mapping and block tables (contract/kv_groups.py)
        slot_names = [n for n in m if is_group_input(n, abi.SLOT_MAPPING)]
        table_names = [n for n in m if is_group_input(n, abi.BLOCK_TABLES)]
        self.slots, self.tables = [m[n] for n in slot_names], [m[n] for n in table_names]
        # (request, its preemptions, its blocks' layout) per row: a request preempted since
        # holds new blocks; a sliding group gives blocks back as well as taking them
        self.rows: list[tuple[int, int, tuple[int, ...]] | None] = [None] * graph.rows
        every = {*self.PER_STEP, *slot_names, abi.INPUT_IDS}
        self._step_bytes = sum(m[n].nbytes for n in every if n in m)
        self._row_bytes = sum(m[n].nbytes for n in {*self.PER_ROW, *table_names} if n in m)
        self._logit_bytes = sum(m[n].nbytes for n in abi.LOGIT_INPUTS if n in m)
        self._masked = False  # a row had a grammar last step: the bitmask is not all ones
        for i in range(graph.rows):
            self._pad(i)

    def fill(self, seqs: list[SequenceState], grammars: MaskFiller | None = None) -> int:
        bs = self.block_size
        rows_changed = logits_changed = False
        for i, seq in enumerate(seqs):
            pos = seq.length - 1  # the last sampled token enters the cache at this position
            used = pos // bs + 1
            if self.ids is not None:
                self.ids[i, 0] = seq.output_ids[-1]
            self.pos[i, 0] = pos
            for slots, blocks in zip(self.slots, seq.kv_blocks, strict=True):
                slots[i, 0] = abi.slot(blocks[used - 1], pos, bs)
            self.lens[i] = pos + 1
            row = self.rows[i]
            new_request = row is None or row[:2] != (seq.request_id, seq.preemptions)
            if new_request or seq.processes_logits:  # counts and min_tokens move every step
                write_row(self.meta, i, seq, self.eos_token_ids)
                logits_changed = True
            key = (seq.request_id, seq.preemptions, held_layout(seq, used))
            if self.rows[i] != key:
                if new_request:
                    write_sampling(self.meta, i, seq)
                    if self.seq_slots is not None:
                        self.seq_slots[i] = seq.state_slot
                for tables, blocks in zip(self.tables, seq.kv_blocks, strict=True):
                    tables[i, :used] = blocks[:used]
                    tables[i, used:] = -1
                self.rows[i] = key
                rows_changed = True
        for i in range(len(seqs), len(self.rows)):
            if self.rows[i] is not None:
                self._pad(i)
                rows_changed = True
        matchers = [s.active_grammar for s in seqs]
        masked = any(m is not None for m in matchers)
        if masked or self._masked:
            fill_bitmasks(self.meta, matchers, grammars)
            logits_changed = True
        self._masked = masked
        changed = self._row_bytes if rows_changed else 0
        return self._step_bytes + changed + (self._logit_bytes if logits_changed else 0)

    def _pad(self, i: int) -> None:
        """A padding row: nothing visible, its K/V write goes to the null slot (and its token
        to the padding slot 0 of the decode state)."""
        for name, values in self.meta.items():
            values[i] = abi.pad_value(name)
        self.rows[i] = None


def held_layout(seq: SequenceState, used: int) -> tuple[int, ...]:
    """What a row's block tables show of `seq`: its blocks in use, and in each KV group the
    blocks given back before them (a sliding group's)."""
    return (used, *(b.count(0) for b in seq.kv_blocks))


def write_blocks(
    meta: dict[str, np.ndarray],
    row: int,
    line: int,
    at: slice,
    seq: SequenceState,
    positions: np.ndarray,
    bs: int,
) -> None:
    """Each KV group's slots of `positions` (at `at` of token line `line`) and row `row`'s
    block tables, up to the block of the last position."""
    used = int(positions[-1]) // bs + 1
    for g, blocks in enumerate(seq.kv_blocks):
        mine = np.asarray(blocks, dtype=np.int64)
        meta[group_input(abi.SLOT_MAPPING, g)][line, at] = abi.slots_of(mine, positions, bs)
        meta[group_input(abi.BLOCK_TABLES, g)][row, :used] = mine[:used]


def padded_metadata(specs: tuple[tuple[str, tuple[int, ...], str], ...]) -> dict[str, np.ndarray]:
    """A graph's metadata arrays, every row padding (abi.PAD_VALUES), ready to be filled."""
    return {name: np.full(shape, abi.pad_value(name), dtype) for name, shape, dtype in specs}


def write_sampling(meta: dict[str, np.ndarray], row: int, seq: SequenceState) -> None:
    """A row's per-request inputs: each sampling one the request's `SamplingParams` field of
    the input's name, but the seed, which the engine draws for an unseeded request (the
    sequence's); its adapter slot where the graph takes one."""
    for name in abi.SAMPLING_NAMES if abi.SEED in meta else ():  # an embed graph samples none
        meta[name][row] = seq.seed if name == abi.SEED else getattr(seq.params, name)
    if abi.LORA_SLOTS in meta:
        meta[abi.LORA_SLOTS][row] = seq.lora_slot


class ModelRunner:
    """A rank's graphs: prefill chunks and decode batches in, sampled tokens out."""

    def __init__(
        self, graphs: list[GraphEntry], config: SchedulerConfig, on_run: OnRun | None = None
    ) -> None:
        self.config = config
        self.graph_list = list(graphs)
        self.graphs = {g.key: g for g in graphs}
        self._index = {g.name: i for i, g in enumerate(graphs)}
        self.on_run = on_run
        self.timings = Timings()
        self._decode_buffers: dict[str, DecodeBuffers] = {}
        self.draft: DraftProposer | None = None  # speculation.method draft: its own graphs
        self.grammars: MaskFiller | None = None  # structured outputs: the engine sets it

    def execute(self, graph: GraphEntry, meta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one graph on host metadata; returns its outputs by name."""
        outs = graph.run([meta[name] for name in graph.meta_inputs])
        return dict(zip(graph.outputs, outs, strict=True))

    def warm_up(self) -> float:
        """Run every graph once on padding (no sequence: nothing is written but the null
        slot), so what a graph's first call costs (its weights paged in, the allocator's and
        the thread pool's first growth) is paid at load, not by the first request; seconds
        taken. Every rank runs the same graphs in the same order (their collectives pair)."""
        t0 = time.perf_counter()
        for graph in self.graph_list:
            self.execute(graph, padded_metadata(graph.meta_specs))
        return time.perf_counter() - t0

    def _run(self, graph: GraphEntry, meta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.on_run is not None:
            self.on_run(self._index[graph.name], meta)
        return self.execute(graph, meta)

    def prefill(self, batch: PrefillBatch) -> StepOutput:
        """Write the chunks' K/V; a sequence's sampled token counts only after its prompt's
        last chunk. The chunks lie side by side in one row of tokens (a one-sequence graph has
        no `seq_ids`); sequences past them pad (no tokens, nothing visible)."""
        graph, meta = self.prefill_metadata(batch)
        t0 = time.perf_counter()
        outputs = self._run(graph, meta)
        self.timings.prefill_s += time.perf_counter() - t0
        self.timings.prefill_chunks += 1
        return StepOutput(outputs)

    def prefill_metadata(self, batch: PrefillBatch) -> tuple[GraphEntry, dict[str, np.ndarray]]:
        """The prefill graph of the batch's buckets and its metadata."""
        graph = self.graphs[GraphKey(Phase.PREFILL, batch.batch, batch.tokens, batch.context)]
        bs = self.config.block_size
        meta = padded_metadata(graph.meta_specs)
        at = 0
        for i, chunk in enumerate(batch.chunks):
            seq, start, n = chunk.seq, chunk.start, chunk.length
            positions = np.arange(start, start + n)
            span = slice(at, at + n)
            meta[abi.POSITIONS][0, span] = positions
            write_blocks(meta, i, 0, span, seq, positions, bs)
            meta[abi.INPUT_IDS][0, span] = seq.prefill_ids[start : start + n]
            if abi.SEQ_IDS in meta:  # a packed graph: each token's sequence
                meta[abi.SEQ_IDS][0, span] = i
            meta[abi.CONTEXT_LENS][i] = start + n
            meta[abi.LAST_TOKEN_INDEX][i] = at + n - 1
            if abi.SEQ_SLOTS in meta:  # device state: where the sequence's token goes
                meta[abi.SEQ_SLOTS][i] = seq.state_slot
            write_sampling(meta, i, seq)
            write_row(meta, i, seq, self.config.eos_token_ids)
            at += n
        # a chunk that is not its prompt's last samples nothing that is kept: no mask needed
        matchers = [
            c.seq.active_grammar if c.start + c.length == len(c.seq.prefill_ids) else None
            for c in batch.chunks
        ]
        if any(m is not None for m in matchers):
            fill_bitmasks(meta, matchers, self.grammars)
        if abi.TARGET_IDS in meta:  # each position's next prompt token (0 past the end)
            (chunk,) = batch.chunks  # prompt logprobs prefill alone (Scheduler.next_prefill)
            following = chunk.seq.prefill_ids[chunk.start + 1 : chunk.start + chunk.length + 1]
            meta[abi.TARGET_IDS][0, : len(following)] = following
        return graph, meta

    def decode(self, batch: DecodeBatch) -> StepOutput:
        if batch.drafts is not None:
            return self.verify(batch)
        graph = self.graphs[GraphKey(Phase.DECODE, batch.batch, 1, batch.context)]
        buffers = self._decode_buffers.get(graph.name)
        if buffers is None:
            buffers = self._decode_buffers[graph.name] = DecodeBuffers(
                graph, self.config.block_size, self.config.eos_token_ids
            )
        self.timings.decode_meta_bytes += buffers.fill(batch.rows, self.grammars)
        t0 = time.perf_counter()
        outputs = self._run(graph, buffers.meta)
        self.timings.decode_s += time.perf_counter() - t0
        self.timings.decode_steps += 1
        self.timings.decode_tokens += len(batch.rows)
        return StepOutput(outputs, graph.name)

    def verify(self, batch: DecodeBatch) -> StepOutput:
        """A verify step: each row's last token and its drafts at their positions (K/V written
        for the real ones; padding drafts are -1, never accepted, written to the null slot)."""
        assert batch.drafts is not None and self.config.speculation is not None
        k = self.config.speculation.num_tokens
        graph = self.graphs[GraphKey(Phase.VERIFY, batch.batch, 1 + k, batch.context)]
        bs = self.config.block_size
        meta = padded_metadata(graph.meta_specs)
        for i, (seq, drafts) in enumerate(zip(batch.rows, batch.drafts, strict=True)):
            start, real = seq.length - 1, 1 + len(drafts)
            positions = start + np.arange(1 + k)
            meta[abi.INPUT_IDS][i] = [seq.output_ids[-1], *drafts, *[-1] * (k - len(drafts))]
            meta[abi.POSITIONS][i] = positions
            write_blocks(meta, i, i, slice(0, real), seq, positions[:real], bs)
            meta[abi.CONTEXT_LENS][i] = start + real
            if abi.SEQ_SLOTS in meta:
                meta[abi.SEQ_SLOTS][i] = seq.state_slot
            write_sampling(meta, i, seq)
            write_row(meta, i, seq, self.config.eos_token_ids)
        matchers = [s.active_grammar for s in batch.rows]
        if any(m is not None for m in matchers):  # fresh metadata allows every token already
            fill_bitmasks(meta, matchers, self.grammars)
        t0 = time.perf_counter()
        outputs = self._run(graph, meta)
        self.timings.decode_s += time.perf_counter() - t0
        self.timings.decode_steps += 1
        self.timings.verify_steps += 1
        emitted = int(outputs[abi.NUM_EMITTED][: len(batch.rows)].sum())
        self.timings.decode_tokens += emitted
        return StepOutput(outputs, graph.name)
