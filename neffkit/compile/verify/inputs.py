"""Representative inputs for `build --verify`: rows with different context lengths, padding and a
random K/V context, laid out by the graph ABI's own rules (contract/abi.py) as the runtime lays
them out."""

from __future__ import annotations

import numpy as np
import torch

from neffkit.compile.layout import graph_inputs
from neffkit.compile.units import GraphSpec, ModelLayout
from neffkit.contract import abi
from neffkit.contract.kv_groups import first_live, group_input
from neffkit.contract.lora import is_adapter_input


def greedy_sampling(rows: int) -> dict[str, np.ndarray]:
    """Every row greedy: the ABI's padding values (temperature 0, top_k 0: off, top_p 1, seed
    0), so a sampling input the ABI adds needs nothing here."""
    return {name: np.full(rows, abi.pad_value(name), dtype) for name, dtype in abi.SAMPLING_INPUTS}


def representative_inputs(
    layout: ModelLayout, spec: GraphSpec, weights: list[torch.Tensor], seed: int = 0
) -> list[torch.Tensor]:
    """Flat graph inputs: rows with different context lengths, padding, random K/V context;
    with adapter slots, random adapters and rows cycling through the base (row 0) and each
    slot."""
    _, specs = graph_inputs(layout, spec)
    gen = torch.Generator().manual_seed(seed)
    bs, nb = layout.block_size, layout.num_blocks
    blocks_per_row = min(spec.context // bs, (nb - 1) // spec.rows)
    tables = np.full((spec.rows, spec.context // bs), -1, dtype=np.int64)
    for r in range(spec.rows):  # distinct blocks per row: no two rows write one slot
        tables[r, :blocks_per_row] = 1 + r * blocks_per_row + np.arange(blocks_per_row)
    capacity = blocks_per_row * bs
    vocab = layout.config.vocab_size
    meta: dict[str, np.ndarray] = {abi.BLOCK_TABLES: tables}
    t, packed = spec.tokens, abi.PHASES[spec.phase].packed
    lines = 1 if packed else spec.rows  # prefill: one (packed) row
    if packed and spec.rows > 1:
        meta |= _packed_prefill(spec.rows, t, tables, bs)
    else:
        if packed:
            valid = max(1, min(t - t // 4, capacity))  # a quarter of the tokens are padding
            positions = np.where(np.arange(t) < valid, np.arange(t), 0)[None, :]
            lens = np.array([valid])
            meta[abi.LAST_TOKEN_INDEX] = np.array([valid - 1])
            live = np.arange(t)[None, :] < valid
        else:  # decode, verify: each row's T tokens end its context
            lens = np.array([max(t, capacity - 1 - 3 * r) for r in range(spec.rows)])
            positions = (lens - t)[:, None] + np.arange(t)[None, :]
            live = np.ones((spec.rows, t), dtype=bool)
        slots = abi.slot(np.take_along_axis(tables, positions // bs, axis=1), positions, bs)
        meta |= {
            abi.POSITIONS: positions.astype(np.int64),
            abi.SLOT_MAPPING: np.where(live, slots, -1).astype(np.int64),
            abi.CONTEXT_LENS: lens.astype(np.int64),
        }
    meta |= group_metadata(layout, meta, spec.rows)
    meta |= {
        abi.INPUT_IDS: torch.randint(0, vocab, (lines, t), generator=gen).numpy(),
        **greedy_sampling(spec.rows),
        abi.TARGET_IDS: torch.randint(0, vocab, (lines, t), generator=gen).numpy(),
        abi.SEQ_SLOTS: tables[:, 0],  # each row's state slot: any distinct one, its first block
        abi.LAST_TOKENS: torch.randint(0, vocab, (nb,), generator=gen).numpy(),
        abi.LORA_SLOTS: np.arange(spec.rows) % (1 + (layout.lora.max_loras if layout.lora else 0)),
    }
    meta |= _logit_inputs(specs, vocab, gen)
    by_name = {w.name: i for i, w in enumerate(layout.weights)}
    out = []
    for s in specs:
        dtype = getattr(torch, s.dtype)
        if s.name in meta:
            out.append(torch.from_numpy(np.ascontiguousarray(meta[s.name])).to(dtype))
        elif s.name in RANDOM_SCALES or abi.is_kv_cache(s.name) or is_adapter_input(s.name):
            out.append((torch.randn(s.shape, generator=gen) * _scale(s.name)).to(dtype))
        elif s.name == abi.RANK:
            out.append(torch.zeros(1, dtype=torch.int64))
        else:
            out.append(weights[by_name[s.name]])
    return out


def group_metadata(
    layout: ModelLayout, meta: dict[str, np.ndarray], rows: int
) -> dict[str, np.ndarray]:
    """Each KV group's block tables and slot mapping (contract/kv_groups.py) for the first
    group's: a full group's are the same; a sliding group's give each row's blocks from its
    window's first (at the row's first query) on fresh blocks of the group's pool, in order
    (wrapping where the rows need more than the pool holds)."""
    out: dict[str, np.ndarray] = {}
    bs, tables = layout.block_size, meta[abi.BLOCK_TABLES]
    positions, slots = meta[abi.POSITIONS], meta[abi.SLOT_MAPPING]
    owner = meta.get(abi.SEQ_IDS, np.arange(positions.shape[0])[:, None] + 0 * positions)
    for g, group in enumerate(layout.kv_groups):
        mine, live = tables.copy(), slots >= 0
        if group.window is not None:
            mine[:] = -1
            taken = 0
            for r in range(rows):
                queries = positions[(owner == r) & live]
                if queries.size == 0:
                    continue
                first = first_live(group.window, int(queries.min()), bs)
                for j in range(first, int(queries.max()) // bs + 1):
                    mine[r, j] = 1 + taken % (group.num_blocks - 1)
                    taken += 1
        block = mine[np.clip(owner, 0, rows - 1), positions // bs]
        out[group_input(abi.BLOCK_TABLES, g)] = mine
        out[group_input(abi.SLOT_MAPPING, g)] = np.where(
            live, abi.slot(block, positions, bs), -1
        ).astype(np.int64)
    return out


RANDOM_SCALES = {abi.PREVIOUS_HIDDEN: 1.0}  # a hidden state's scale: unit normal


def _scale(name: str) -> float:
    """The spread of a random static input: K/V context at 0.5; adapter slots small against
    the weights, as trained adapters are."""
    if abi.is_kv_cache(name):
        return 0.5
    return 0.05 if is_adapter_input(name) else RANDOM_SCALES[name]


def _packed_prefill(seqs: int, tokens: int, tables: np.ndarray, bs: int) -> dict[str, np.ndarray]:
    """A packed prefill row: three quarters of the tokens split among the sequences (the last
    may get none: a padding sequence), each after some context already in its cache."""
    capacity = int((tables[0] >= 0).sum()) * bs
    valid = tokens - tokens // 4
    counts = [min(valid // seqs + (s < valid % seqs), capacity) for s in range(seqs)]
    counts[-1] = 0 if seqs > 2 else counts[-1]  # a padding sequence, where there is room
    positions = np.zeros((1, tokens), np.int64)
    seq_ids = np.zeros((1, tokens), np.int64)
    slots = np.full((1, tokens), -1, np.int64)
    lens, last = np.zeros(seqs, np.int64), np.zeros(seqs, np.int64)
    at = 0
    for s, n in enumerate(counts):
        if n == 0:
            continue
        start = max(0, min(3 * s, capacity - n))  # earlier chunks of this prompt in the cache
        pos = start + np.arange(n)
        positions[0, at : at + n], seq_ids[0, at : at + n] = pos, s
        slots[0, at : at + n] = abi.slots_of(tables[s], pos, bs)
        lens[s], last[s] = start + n, at + n - 1
        at += n
    return {
        abi.POSITIONS: positions,
        abi.SEQ_IDS: seq_ids,
        abi.SLOT_MAPPING: slots,
        abi.CONTEXT_LENS: lens,
        abi.LAST_TOKEN_INDEX: last,
    }


def _logit_inputs(specs: list, vocab: int, gen: torch.Generator) -> dict[str, np.ndarray]:
    """Every row constrained: half the vocabulary masked at random, penalties on random tokens
    (some pairs padding), random biases, so a compiled graph's processing is compared too."""
    out: dict[str, np.ndarray] = {}
    for s in specs:
        if s.name == abi.TOKEN_BITMASK:
            bits = torch.randint(-(2**31), 2**31 - 1, s.shape, generator=gen, dtype=torch.int64)
            out[s.name] = bits.to(torch.int32).numpy()
        elif s.name in (abi.PENALTY_IDS, abi.BIAS_IDS):
            out[s.name] = torch.randint(-1, vocab, s.shape, generator=gen).numpy()
        elif s.name == abi.PENALTY_COUNTS:
            out[s.name] = torch.randint(0, 3, s.shape, generator=gen).float().numpy()
        elif s.name == abi.BIAS_VALUES:
            out[s.name] = (torch.randn(s.shape, generator=gen) * 3).numpy()
        elif s.name == "repetition_penalty":
            out[s.name] = (1 + torch.rand(s.shape, generator=gen)).numpy()
        elif s.name in abi.PENALTY_NAMES:
            out[s.name] = (torch.rand(s.shape, generator=gen) * 2 - 1).numpy()
    return out
