"""Where an fp8 cache with rotated keys (kv_cache.rotate_keys) measures each key from: the
decoder's part that puts a layer's calibrated offsets through its own positional encoding, at
the positions of this step's keys and of the context it reads (kernels/kv.py stores and reads
them; compile/calibrate.py measures them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from neffkit.kernels.kv import offset_scores, rope_offset_scores, stored_keys, stored_queries
from neffkit.kernels.rope import rope_cos_sin
from neffkit.models.shards import K_ROTATION, ROPE_INV_FREQ
from neffkit.models.step import Step

if TYPE_CHECKING:
    from neffkit.contract.abi import GraphShape

# a layer's positional encoding of q and k (DecoderGraph.positional)
Positional = Callable[[torch.Tensor, torch.Tensor, int, Step], tuple[torch.Tensor, torch.Tensor]]


class KeyOffsets:
    """Mixed into DecoderGraph: it supplies `positional`, `rope`, `rotary`,
    `rope_attention_factor` and `shape`."""

    if TYPE_CHECKING:  # DecoderGraph's
        shape: GraphShape
        rope_attention_factor: float

        @staticmethod
        def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...
        def rope(self, layer: int, step: Step) -> tuple[torch.Tensor, torch.Tensor]: ...
        def positional(
            self, q: torch.Tensor, k: torch.Tensor, layer: int, step: Step
        ) -> tuple[torch.Tensor, torch.Tensor]: ...

    # `positional` is `rotary` with the layer's `rope` tables (not Llama 4's NoPE layers and L2
    # norms): the context's offset scores then come from the shared cos/sin table
    offsets_follow_rope = True

    def offset_bias(self, q: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        """q . offset(c) for every context key c [B, KV, G, T, C]: what paged_attention adds
        to the stored keys' scores (`q`: the query as RoPE left it)."""
        context = step.context
        assert context is not None  # the caller's condition: rotated keys have a context step
        if not self.offsets_follow_rope:
            return offset_scores(q, self.key_offsets(layer, context))
        p = f"model.layers.{layer}.self_attn"
        mean, first = step.w[f"{p}.k_offset"], step.w[f"{p}.k_first"]
        mean = mean.to(q.dtype)
        ones, zeros = torch.ones_like(mean), torch.zeros_like(mean)
        coefs = torch.cat((self.rotary(mean, ones, zeros), self.rotary(mean, zeros, ones)), -1)
        cos, sin = self.rope(layer, context)  # [1, C, 1, D]
        half = cos.shape[-1] // 2
        table = torch.cat((cos[0, :, 0, :half], sin[0, :, 0, :half]), -1)  # [C, D]
        return rope_offset_scores(q, coefs, first, table, context.positions[0])

    def stored_forms(
        self, q: torch.Tensor, k: torch.Tensor, layer: int, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query and key as an fp8 cache with rotated keys takes them (kernels/kv.py)."""
        w, p = step.w, f"model.layers.{layer}.self_attn"
        smooth, rotation = w[f"{p}.k_smooth"], w[K_ROTATION]
        k = stored_keys(k, self.key_offsets(layer, step), smooth, rotation)
        return stored_queries(q, smooth, rotation), k

    def context_step(self, step: Step, packed: bool) -> Step:
        """`step` at the positions of the context keys it reads [1, C] (packed prefill: every
        sequence's context side by side, each from position 0)."""
        keys = torch.arange(step.block_tables.shape[-1] * step.caches[0].shape[1])
        keys = keys % self.shape.context if packed else keys
        return self.at_positions(step, keys.reshape(1, -1))

    def at_positions(self, step: Step, positions: torch.Tensor) -> Step:
        """`step` with RoPE at other positions [B, T] (Gemma 3: its local rotation too)."""
        cos, sin = rope_cos_sin(
            positions, step.w[ROPE_INV_FREQ], self.rope_attention_factor, step.cos.dtype
        )
        return dataclasses.replace(step, cos=cos, sin=sin, positions=positions, context=None)

    def key_offsets(self, layer: int, step: Step) -> torch.Tensor:
        """What an fp8 cache with rotated keys stores a key less, at each of the step's
        positions [B, T, KV, D]: the layer's calibrated mean key before RoPE (k_offset) put
        through the layer's own positional encoding, and at position 0 the calibrated first
        key (k_first: the attention sink, close to the same vector whatever the text, which a
        mean does not fit and whose rounding would move every score of a sink-heavy layer)."""
        p = f"model.layers.{layer}.self_attn"
        mean, first = step.w[f"{p}.k_offset"], step.w[f"{p}.k_first"]
        return offsets_at(self.positional, layer, step, mean, first)


def offsets_at(
    positional: Positional, layer: int, step: Step, mean: torch.Tensor, first: torch.Tensor
) -> torch.Tensor:
    """The offsets [B, T, KV, D] at the step's positions from a layer's mean key before its
    positional encoding and its first key [KV, D], through `positional` (the layer's own; the
    calibration's before it watches the layer)."""
    mean = mean.to(step.cos.dtype).expand(*step.positions.shape, *mean.shape)
    _, offsets = positional(mean, mean, layer, step)
    first = first.to(offsets.dtype)
    return torch.where((step.positions == 0)[..., None, None], first, offsets)
