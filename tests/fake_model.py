"""A stand-in for compiled graphs that honours the paged-KV contract, for scheduler tests in ms.

Each graph entry is a real `runner.GraphEntry` whose `run` reads the metadata the real runner
builds. Like a real layer's K/V, what a token writes to its slot of the shared cache
(`slot_mapping`, -1 = padding, which lands in the null block as the real kernels do) depends on
the whole prefix: kv[p] = (token[p] + 3 * kv[p - 1]) mod the vocabulary, kv[p - 1] read back
through the block table. A row's next token is the sum of the kv it attends (`block_tables` +
`context_lens`) modulo the vocabulary, plus the row's seed when it samples (`temperature > 0`).
So a wrong slot, block table, length or sampling row, or a cached block shared between different
prefixes, changes the tokens; `oracle` computes the right ones straight from the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from neffkit.contract.abi import GraphKey
from neffkit.contract.records import BucketLists, LayoutRecord, ModelRecord, SpeculationRecord
from neffkit.runtime.config import SchedulerConfig
from neffkit.runtime.worker.runner import GraphEntry, ModelRunner

VOCAB = 97
EOS = 96


def kv_values(tokens: list[int]) -> list[int]:
    """What each position of a sequence holds in the fake cache: a rolling hash of its prefix."""
    kv, prev = [], 0
    for t in tokens:
        prev = (t + 3 * prev) % VOCAB
        kv.append(prev)
    return kv


def oracle(
    prompt: list[int], n: int, seed: int = 0, sampled: bool = False, period: int | None = None
) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        base = seq[-period] if period and len(seq) >= period else sum(kv_values(seq))
        token = (base + (seed if sampled else 0)) % VOCAB
        out.append(token)
        seq.append(token)
    return out


def _specs(phase: str, rows: int, tokens: int, context: int, block_size: int) -> tuple:
    lines = 1 if phase == "prefill" else rows  # prefill: the sequences' tokens in one row
    specs = [
        ("input_ids", (lines, tokens), "int64"),
        ("positions", (lines, tokens), "int64"),
        ("slot_mapping", (lines, tokens), "int64"),
        ("block_tables", (rows, context // block_size), "int64"),
        ("context_lens", (rows,), "int64"),
    ]
    if phase == "prefill" and rows > 1:
        specs.append(("seq_ids", (1, tokens), "int64"))
    if phase == "prefill":
        specs.append(("last_token_index", (rows,), "int64"))
    specs += [
        ("temperature", (rows,), "float32"),
        ("top_k", (rows,), "int64"),
        ("top_p", (rows,), "float32"),
        ("seed", (rows,), "int64"),
    ]
    return tuple(specs)


@dataclass
class PagedSumModel:
    layout: SchedulerConfig
    calls: list[tuple[str, dict[str, np.ndarray]]] = field(default_factory=list)
    # a model that repeats its input with this period (the token `period` back, recovered from
    # the cache's rolling hashes), so prompt lookup's drafts are often right
    period: int | None = None

    def __post_init__(self) -> None:
        self.cache = np.zeros(self.layout.num_blocks * self.layout.block_size, dtype=np.int64)

    def run(self, name: str, specs: tuple, arrays: list[np.ndarray]) -> list[np.ndarray]:
        meta = {spec[0]: a.copy() for spec, a in zip(specs, arrays, strict=True)}
        self.calls.append((name, meta))
        bs = self.layout.block_size
        self._write(meta, bs)
        if name.startswith("verify"):
            return self._verify(meta, bs)
        out = np.zeros(len(meta["context_lens"]), dtype=np.int64)
        for row, length in enumerate(meta["context_lens"]):
            table = meta["block_tables"][row]
            assert (table[: -(-length // bs)] > 0).all(), "a used block-table entry is null"
            seed = meta["seed"][row] if meta["temperature"][row] > 0 else 0
            out[row] = self._token(table, int(length), seed, bs)
        return [out]

    def _token(self, table: np.ndarray, length: int, seed: int, bs: int) -> int:
        """The token after the first `length` positions of a row (read through its table)."""
        kv = self.cache[table[np.arange(length) // bs] * bs + np.arange(length) % bs]
        if self.period and length >= self.period:
            at = length - self.period
            base = kv[at] - 3 * (kv[at - 1] if at else 0)  # the token there, from the hashes
        else:
            base = kv.sum()
        return int((base + seed) % VOCAB)

    def _verify(self, meta: dict[str, np.ndarray], bs: int) -> list[np.ndarray]:
        """Every position's token as a decode step there gives it; drafts (a row's tokens after
        the first) accepted while they equal the token before them, as the real graph does."""
        rows, tokens = meta["input_ids"].shape
        out = np.zeros((rows, tokens), dtype=np.int64)
        emitted = np.ones(rows, dtype=np.int64)
        for row in range(rows):
            table = meta["block_tables"][row]
            seed = meta["seed"][row] if meta["temperature"][row] > 0 else 0
            for t in range(tokens):
                length = min(meta["positions"][row, t] + 1, meta["context_lens"][row])
                out[row, t] = self._token(table, int(length), seed, bs)
            while (
                emitted[row] < tokens
                and out[row, emitted[row] - 1] == meta["input_ids"][row, emitted[row]]
            ):
                emitted[row] += 1
        return [out, emitted]

    def _write(self, meta: dict[str, np.ndarray], bs: int) -> None:
        """Each real token's kv, in order (a chunk reads its own earlier tokens back)."""
        lines, tokens = meta["input_ids"].shape
        for line in range(lines):
            for i in range(tokens):
                slot = meta["slot_mapping"][line, i]
                if slot < 0:
                    continue
                pos = meta["positions"][line, i]
                row = meta["seq_ids"][0, i] if "seq_ids" in meta else line
                prev = 0
                if pos > 0:
                    table = meta["block_tables"][row]
                    prev = self.cache[table[(pos - 1) // bs] * bs + (pos - 1) % bs]
                self.cache[slot] = (meta["input_ids"][line, i] + 3 * prev) % VOCAB

    def graph(self, phase: str, rows: int, tokens: int, context: int) -> GraphEntry:
        specs = _specs(phase, rows, tokens, context, self.layout.block_size)
        name = f"{phase}_{rows}x{tokens}_c{context}"
        outputs = ("next_tokens", "num_emitted") if phase == "verify" else ("next_tokens",)
        return GraphEntry(
            name=name,
            key=GraphKey(phase, rows, tokens, context),
            meta_specs=specs,
            run=lambda a: self.run(name, specs, a),
            outputs=outputs,
        )


def scheduler_config(
    block_size: int,
    num_blocks: int,
    buckets: BucketLists,
    eos: tuple[int, ...] = (EOS,),
    speculation: SpeculationRecord | None = None,
    **layout: Any,
) -> SchedulerConfig:
    """The scheduler's view of a made-up bundle: its layout and model records (one layer, the
    fake model's vocabulary), as a built bundle records them."""
    record = LayoutRecord(
        world_size=1,
        tp=1,
        ep=1,
        dtype="float32",
        num_layers=1,
        kv_heads_per_rank=1,
        rank_input=False,
        head_dim=1,
        block_size=block_size,
        num_blocks=num_blocks,
        buckets=buckets,
        max_top_k=layout.pop("max_top_k", 1 << 30),  # by default a cap no request reaches
        kv_dtype="float32",
        speculation=speculation,
        **layout,
    )
    model = ModelRecord("PagedSum", 1, VOCAB, eos, {})
    return SchedulerConfig(record, model, record.prefix_caching, speculation)


def fake_runner(
    prefill: tuple[int, ...] = (8, 16),
    decode: tuple[int, ...] = (1, 4),
    context: tuple[int, ...] = (32, 64),
    num_blocks: int = 33,
    block_size: int = 8,
    eos: tuple[int, ...] = (EOS,),
    prefill_batch: tuple[int, ...] = (1,),
    speculation: SpeculationRecord | None = None,
    period: int | None = None,
) -> tuple[ModelRunner, PagedSumModel]:
    layout = scheduler_config(
        block_size,
        num_blocks,
        BucketLists(prefill, decode, context, prefill_batch),
        eos=eos,
        speculation=speculation,
    )
    model = PagedSumModel(layout, period=period)
    graphs = [
        model.graph("prefill", r, t, c)
        for r in prefill_batch
        for t in prefill
        for c in context
        if t <= c
    ]
    graphs += [model.graph("decode", b, 1, c) for b in decode for c in context]
    if speculation is not None:
        k = speculation.num_tokens
        graphs += [
            model.graph("verify", b, 1 + k, c)
            for b in decode
            if b <= speculation.max_batch
            for c in context
        ]
    return ModelRunner(graphs, layout), model
