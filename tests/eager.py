"""neffkit's graphs run eagerly: the modules a build traces (`decoder_module`), called with the
inputs the runtime would send, on one set of K/V caches. Nothing is traced or compiled, so a
family's model code is checked against HF in seconds, prefill and decode alike."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from neffkit.compile.layout import graph_inputs
from neffkit.compile.trace import decoder_module
from neffkit.compile.units import GraphSpec, ModelLayout
from neffkit.compile.verify.inputs import greedy_sampling
from neffkit.contract import abi


class EagerGraphs:
    """A layout's prefill and decode graphs of `rows` rows, run eagerly on one set of K/V caches
    (and, with device state, one last_tokens tensor)."""

    def __init__(
        self,
        layout: ModelLayout,
        weights: dict[str, torch.Tensor],
        prefill: GraphSpec,
        decode: GraphSpec,
    ) -> None:
        self.layout = layout
        self.prefill = decoder_module(layout, prefill)
        self.decode = decoder_module(layout, decode)
        _, specs = graph_inputs(layout, decode)
        self.state = {
            s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype))
            for s in specs
            if abi.is_kv_cache(s.name) or s.name == abi.LAST_TOKENS
        }
        self.weights = weights

    def run(self, graph: tuple[torch.nn.Module, list[Any]], meta: dict[str, Any]) -> np.ndarray:
        """The graph's first output (each row's sampled token) for these inputs; inputs the
        caller leaves out get their no-op padding."""
        module, specs = graph
        inputs = []
        for s in specs:
            if s.name in self.state:
                inputs.append(self.state[s.name])
            elif s.name in self.weights:
                inputs.append(self.weights[s.name])
            else:
                value = meta.get(s.name, np.full(s.shape, abi.pad_value(s.name)))
                inputs.append(torch.from_numpy(np.asarray(value, dtype=s.dtype)))
        with torch.no_grad():
            return module(*inputs)[0].numpy()


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def eager_greedy(
    layout: ModelLayout, weights: dict[str, torch.Tensor], prompts: list[list[int]], max_new: int
) -> list[list[int]]:
    """Greedy tokens of every prompt: one prefill with the prompts packed into one row (each
    sequence its own blocks), then `max_new - 1` decode steps of all rows together."""
    rows, bs = len(prompts), layout.block_size
    context = _round_up(max(map(len, prompts)) + max_new, bs)
    per_row = context // bs
    # every layer's cache whole (one KV group): the windows are the masks' alone here
    layout = dataclasses.replace(layout, num_blocks=rows * per_row + 1, kv_groups=())
    tables = 1 + np.arange(rows * per_row).reshape(rows, per_row)
    tokens = _round_up(sum(map(len, prompts)), 16)
    graphs = EagerGraphs(
        layout,
        weights,
        GraphSpec("prefill", "prefill", rows, tokens, context),
        GraphSpec("decode", "decode", rows, 1, context),
    )
    seq_slots = tables[:, 0]
    out = [[int(t)] for t in graphs.run(graphs.prefill, _packed(prompts, tables, tokens, bs))]
    for _ in range(max_new - 1):
        pos = np.array([[len(p) + len(o) - 1] for p, o in zip(prompts, out, strict=True)])
        slots = np.take_along_axis(tables, pos // bs, axis=1) * bs + pos % bs
        meta = {
            abi.INPUT_IDS: np.array([[o[-1]] for o in out]),
            abi.POSITIONS: pos,
            abi.SLOT_MAPPING: slots,
            abi.BLOCK_TABLES: tables,
            abi.CONTEXT_LENS: pos[:, 0] + 1,
            abi.SEQ_SLOTS: seq_slots,
            **greedy_sampling(rows),
        }
        for o, t in zip(out, graphs.run(graphs.decode, meta), strict=True):
            o.append(int(t))
    return out


def _packed(
    prompts: list[list[int]], tables: np.ndarray, tokens: int, bs: int
) -> dict[str, np.ndarray]:
    """The prefill's inputs: every prompt's tokens one after the other in one row, padding
    after them (position 0, no slot)."""
    ids, pos, seq_ids = (np.zeros((1, tokens), np.int64) for _ in range(3))
    slots = np.full((1, tokens), -1, np.int64)
    last = np.zeros(len(prompts), np.int64)
    at = 0
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        ids[0, at : at + n], pos[0, at : at + n], seq_ids[0, at : at + n] = prompt, range(n), row
        slots[0, at : at + n] = abi.slots_of(tables[row], np.arange(n), bs)
        last[row] = at + n - 1
        at += n
    return {
        abi.INPUT_IDS: ids,
        abi.POSITIONS: pos,
        abi.SLOT_MAPPING: slots,
        abi.SEQ_IDS: seq_ids,
        abi.BLOCK_TABLES: tables,
        abi.CONTEXT_LENS: np.array(list(map(len, prompts))),
        abi.LAST_TOKEN_INDEX: last,
        abi.SEQ_SLOTS: tables[:, 0],
        **greedy_sampling(len(prompts)),
    }
