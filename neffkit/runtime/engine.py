"""Scheduler and generation loop over a bundle's graphs.

Each step runs at most one prefill chunk (the smallest prefill bucket that fits, prompts longer than
the largest bucket run as several chunks) and then one decode step over the running sequences (the
smallest batch and context buckets that fit, rows padded). Metadata is built on the host with numpy;
only the sampled tokens are read back. KV blocks for a request's whole budget (prompt + max_tokens)
are reserved when it is admitted, so a running request never runs out of cache.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from neffkit.errors import RequestError
from neffkit.runtime.kv import BlockAllocator

# metadata arrays in the graph's input order → sampled tokens; the executor binds the rest
Executable = Callable[[list[np.ndarray]], np.ndarray]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # <= 0: no top-k beyond the bundle's max_top_k
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class GraphEntry:
    """One compiled graph as the engine sees it: its bucket and its metadata input order."""

    name: str
    phase: str
    rows: int
    tokens: int
    context: int
    meta_specs: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) in input order
    run: Executable

    @property
    def meta_inputs(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.meta_specs)


@dataclass(frozen=True)
class Layout:
    block_size: int
    num_blocks: int
    prefill_buckets: tuple[int, ...]
    decode_buckets: tuple[int, ...]
    context_buckets: tuple[int, ...]
    eos_token_ids: tuple[int, ...]


@dataclass
class SequenceState:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_prefilled: int = 0
    finish_reason: str | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Timings:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    prefill_chunks: int = 0


def _smallest_fitting(buckets: Sequence[int], need: int) -> int | None:
    i = bisect.bisect_left(buckets, need)
    return buckets[i] if i < len(buckets) else None


class DecodeBuffers:
    """One decode graph's metadata arrays, allocated once and updated in place every step.

    A decode step changes few values per row (token, position, slot, length); the block table
    row changes when a sequence enters a new block and the sampling values when a row gets
    another sequence. Passing the same arrays every step also lets the executor bind them to
    the graph once (it compares the arrays it is given with the last call's). Keeps the host's
    share of a demo-model decode step small.
    """

    def __init__(self, graph: GraphEntry, layout: Layout) -> None:
        self.block_size = layout.block_size
        self.meta = {name: np.empty(shape, dtype) for name, shape, dtype in graph.meta_specs}
        m = self.meta
        self.ids, self.pos, self.slots = m["input_ids"], m["positions"], m["slot_mapping"]
        self.tables, self.lens = m["block_tables"], m["context_lens"]
        self.rows: list[tuple[int, int] | None] = [None] * graph.rows  # (request, blocks) per row
        for i in range(graph.rows):
            self._pad(i)

    def fill(self, seqs: list[SequenceState]) -> None:
        bs = self.block_size
        for i, seq in enumerate(seqs):
            pos = seq.length - 1  # the last sampled token enters the cache at this position
            used = pos // bs + 1
            self.ids[i, 0] = seq.output_ids[-1]
            self.pos[i, 0] = pos
            self.slots[i, 0] = seq.blocks[used - 1] * bs + pos % bs
            self.lens[i] = pos + 1
            if self.rows[i] != (seq.request_id, used):
                row = self.rows[i]
                if row is None or row[0] != seq.request_id:
                    self._sampling(i, seq)
                self.tables[i, :used] = seq.blocks[:used]
                self.tables[i, used:] = -1
                self.rows[i] = (seq.request_id, used)
        for i in range(len(seqs), len(self.rows)):
            if self.rows[i] is not None:
                self._pad(i)

    def _sampling(self, i: int, seq: SequenceState) -> None:
        m, p = self.meta, seq.params
        m["temperature"][i], m["top_k"][i], m["top_p"][i] = p.temperature, p.top_k, p.top_p
        m["seed"][i] = seq.seed

    def _pad(self, i: int) -> None:
        """A padding row: nothing visible, its K/V write goes to the null slot."""
        self.ids[i], self.pos[i], self.slots[i], self.tables[i], self.lens[i] = 0, 0, -1, -1, 0
        m = self.meta
        m["temperature"][i], m["top_k"][i], m["top_p"][i], m["seed"][i] = 0, 0, 1, 0
        self.rows[i] = None


class Engine:
    """Continuous batching over fixed-shape graphs. Not thread-safe: one caller drives `step`."""

    def __init__(
        self,
        graphs: list[GraphEntry],
        layout: Layout,
        on_run: Callable[[int, dict[str, np.ndarray]], None] | None = None,
    ) -> None:
        self.layout = layout
        self.graph_list = list(graphs)
        self._graph_index = {g.name: i for i, g in enumerate(graphs)}
        # called with (graph index, metadata) before every graph call: multi-rank broadcast
        self.on_run = on_run
        self.graphs = {
            (g.phase, g.tokens if g.phase == "prefill" else g.rows, g.context): g for g in graphs
        }
        self.allocator = BlockAllocator(layout.num_blocks)
        self.waiting: deque[SequenceState] = deque()
        self.prefilling: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self.timings = Timings()
        self._ids = itertools.count()
        self._decode_buffers: dict[str, DecodeBuffers] = {}
        self._seed_rng = np.random.default_rng()

    # ------------------------------------------------------------ requests

    @property
    def max_model_len(self) -> int:
        return self.layout.context_buckets[-1]

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse what no bucket can serve, with the buckets in the message."""
        if not prompt_ids:
            raise RequestError("prompt is empty: at least one token is needed")
        if params.max_tokens <= 0:
            raise RequestError(f"max_tokens must be positive, got {params.max_tokens}")
        if params.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {params.temperature}")
        if not 0 < params.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {params.top_p}")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the largest context bucket ({self.max_model_len}); context buckets: "
                f"{list(self.layout.context_buckets)}",
                hint="shorten the prompt, lower max_tokens, or build with a larger context bucket",
            )
        if self._blocks_needed(total) > self.allocator.num_usable:
            raise RequestError(
                f"request needs {self._blocks_needed(total)} KV blocks; the bundle has "
                f"{self.allocator.num_usable}"
            )

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> SequenceState:
        self.validate(prompt_ids, params)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**31))
        seq = SequenceState(next(self._ids), list(prompt_ids), params, seed & 0xFFFFFFFF)
        self.waiting.append(seq)
        return seq

    def abort(self, seq: SequenceState, reason: str = "abort") -> None:
        """End a request wherever it is and free its blocks (client went away, stop string)."""
        if seq.finished:
            return
        seq.finish_reason = reason
        self._release(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.allocator.num_free / self.allocator.num_usable

    def _blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.layout.block_size)

    def _release(self, seq: SequenceState) -> None:
        for queue in (self.waiting, self.prefilling):
            if seq in queue:
                queue.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq.blocks:
            self.allocator.free(seq.blocks)
            seq.blocks = []

    # ------------------------------------------------------------ scheduling

    def step(self) -> list[SequenceState]:
        """Admit what fits, run one prefill chunk and one decode step; return touched sequences."""
        self._admit()
        touched: list[SequenceState] = []
        if self.prefilling:
            touched += self._prefill_chunk(self.prefilling[0])
        if self.running:
            touched += self._decode_step()
        return touched

    def _admit(self) -> None:
        while self.waiting:
            seq = self.waiting[0]
            need = self._blocks_needed(len(seq.prompt_ids) + seq.params.max_tokens)
            if need > self.allocator.num_free:
                return
            self.waiting.popleft()
            seq.blocks = self.allocator.allocate(need)
            self.prefilling.append(seq)

    def _block_table(self, seq: SequenceState, context: int, tokens: int) -> np.ndarray:
        row = np.full(context // self.layout.block_size, -1, dtype=np.int64)
        used = self._blocks_needed(tokens)
        row[:used] = seq.blocks[:used]
        return row

    def _slots(self, seq: SequenceState, positions: np.ndarray) -> np.ndarray:
        blocks = np.asarray(seq.blocks, dtype=np.int64)
        bs = self.layout.block_size
        return blocks[positions // bs] * bs + positions % bs

    def _run(self, graph: GraphEntry, meta: dict[str, np.ndarray]) -> np.ndarray:
        if self.on_run is not None:
            self.on_run(self._graph_index[graph.name], meta)
        return self.execute(graph, meta)

    def execute(self, graph: GraphEntry, meta: dict[str, np.ndarray]) -> np.ndarray:
        """Run one graph on host metadata; returns the sampled tokens."""
        return graph.run([meta[name] for name in graph.meta_inputs])

    def _sampling_meta(self, rows: list[SequenceState], bucket: int) -> dict[str, np.ndarray]:
        meta = {
            "temperature": np.zeros(bucket, dtype=np.float32),
            "top_k": np.zeros(bucket, dtype=np.int64),
            "top_p": np.ones(bucket, dtype=np.float32),
            "seed": np.zeros(bucket, dtype=np.int64),
        }
        for i, seq in enumerate(rows):
            meta["temperature"][i] = seq.params.temperature
            meta["top_k"][i] = seq.params.top_k
            meta["top_p"][i] = seq.params.top_p
            meta["seed"][i] = seq.seed
        return meta

    def _prefill_chunk(self, seq: SequenceState) -> list[SequenceState]:
        start = seq.num_prefilled
        remaining = len(seq.prompt_ids) - start
        largest = self.layout.prefill_buckets[-1]
        n = min(remaining, largest)
        tokens = _smallest_fitting(self.layout.prefill_buckets, n)
        context = _smallest_fitting(self.layout.context_buckets, max(start + n, tokens))
        graph = self.graphs[("prefill", tokens, context)]
        positions = np.zeros((1, tokens), dtype=np.int64)
        positions[0, :n] = np.arange(start, start + n)
        slots = np.full((1, tokens), -1, dtype=np.int64)
        slots[0, :n] = self._slots(seq, positions[0, :n])
        input_ids = np.zeros((1, tokens), dtype=np.int64)
        input_ids[0, :n] = seq.prompt_ids[start : start + n]
        meta = {
            "input_ids": input_ids,
            "positions": positions,
            "slot_mapping": slots,
            "block_tables": self._block_table(seq, context, start + n)[None],
            "context_lens": np.array([start + n], dtype=np.int64),
            "last_token_index": np.array([n - 1], dtype=np.int64),
            **self._sampling_meta([seq], 1),
        }
        t0 = time.perf_counter()
        next_tokens = self._run(graph, meta)
        self.timings.prefill_s += time.perf_counter() - t0
        self.timings.prefill_chunks += 1
        seq.num_prefilled += n
        if seq.num_prefilled < len(seq.prompt_ids):
            return []
        self.prefilling.popleft()
        self.running.append(seq)
        self._append_token(seq, int(next_tokens[0]))
        return [seq]

    def _decode_step(self) -> list[SequenceState]:
        largest = self.layout.decode_buckets[-1]
        rows = self.running[:largest]
        if len(self.running) > largest:
            # Rotate so that more sequences than the largest bucket all make progress.
            self.running = self.running[largest:] + rows
        batch = _smallest_fitting(self.layout.decode_buckets, len(rows))
        context = _smallest_fitting(self.layout.context_buckets, max(s.length for s in rows))
        graph = self.graphs[("decode", batch, context)]
        buffers = self._decode_buffers.get(graph.name)
        if buffers is None:
            buffers = self._decode_buffers[graph.name] = DecodeBuffers(graph, self.layout)
        buffers.fill(rows)
        t0 = time.perf_counter()
        next_tokens = self._run(graph, buffers.meta)
        self.timings.decode_s += time.perf_counter() - t0
        self.timings.decode_steps += 1
        self.timings.decode_tokens += len(rows)
        for seq, token in zip(rows, next_tokens.tolist(), strict=False):  # padding rows last
            self._append_token(seq, token)
        return rows

    def _append_token(self, seq: SequenceState, token: int) -> None:
        seq.output_ids.append(token)
        params = seq.params
        if not params.ignore_eos and token in self.layout.eos_token_ids:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= params.max_tokens:
            seq.finish_reason = "length"
        if seq.finished:
            self._release(seq)

    # ------------------------------------------------------------ offline generation

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[SequenceState]:
        """Run prompts to completion together; results in the order given."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        for prompt, p in zip(prompts, per_prompt, strict=True):
            self.validate(prompt, p)
        seqs = [self.add_request(prompt, p) for prompt, p in zip(prompts, per_prompt, strict=True)]
        while self.has_work():
            self.step()
        return seqs
