"""LoRA adapter slots in bundle.json and in the graph ABI (the manifest's `lora:`).

A bundle built with `lora:` takes, per adapted projection, two persistent inputs the runtime
owns and rewrites in place when it loads an adapter (a copy, never a recompile):
`<prefix>.lora_a` [in, max_loras, max_rank] and `<prefix>.lora_b` [max_loras, max_rank, out],
where `<prefix>` is the projection weight's name less `.weight` and in / out are this rank's
(tp splits B of a column-parallel projection by its outputs and A of a row-parallel one by its
inputs, as the base weight is split). Every graph takes `lora_slots` [B]: each row's adapter,
1 .. max_loras, and 0 for the base model (vllm-neuron's "slot 0 is the base" rule; slot s is
stored at index s - 1, so no zeros are read for the base). The scaling (alpha / r) is folded
into B when an adapter is written. Imports nothing from neffkit but the codec, and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from neffkit.contract.codec import Record

LORA_A, LORA_B = "lora_a", "lora_b"
COLUMN, ROW = "column", "row"  # how tp splits a projection (and its adapter)


@dataclass(frozen=True)
class LoraTarget(Record):
    """One adapted projection: its weight's prefix, its whole (unsplit) shape, its tp split and
    each rank's (start, size) along the split dimension (the base weight's cut: KV heads
    replicated where tp exceeds them)."""

    prefix: str  # "model.layers.0.self_attn.q_proj"
    in_features: int
    out_features: int
    split: str  # COLUMN (outputs split across ranks) or ROW (inputs split)
    spans: tuple[tuple[int, int], ...] = ()  # per rank; () at tp 1

    @property
    def module(self) -> str:
        """The module name PEFT's `target_modules` uses: "q_proj"."""
        return self.prefix.rsplit(".", 1)[-1]

    def span(self, rank: int) -> tuple[int, int]:
        """(start, size) of `rank`'s part along the split dimension."""
        if not self.spans:
            return 0, self.out_features if self.split == COLUMN else self.in_features
        return self.spans[rank]

    def local(self, tp: int) -> tuple[int, int]:
        """(in, out) on each rank of `tp` (every rank's part has the same size)."""
        size = self.span(0)[1] if tp > 1 else None
        if self.split == COLUMN:
            return self.in_features, size or self.out_features
        return size or self.in_features, self.out_features


@dataclass(frozen=True)
class LoraRecord(Record):
    """The manifest's `lora:` as built: slots, the largest rank, the adapted modules and each
    adapted projection, the slots' dtype (the model's compute dtype)."""

    max_loras: int
    max_rank: int
    modules: tuple[str, ...]
    dtype: str
    targets: tuple[LoraTarget, ...]

    def input_specs(self, tp: int = 1) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype) of the slot tensors, in graph input order (A, B per target)."""
        specs: list[tuple[str, tuple[int, ...], str]] = []
        slots, rank = self.max_loras, self.max_rank
        for target in self.targets:
            n_in, n_out = target.local(tp)
            specs.append((f"{target.prefix}.{LORA_A}", (n_in, slots, rank), self.dtype))
            specs.append((f"{target.prefix}.{LORA_B}", (slots, rank, n_out), self.dtype))
        return specs

    def names(self) -> list[str]:
        return [name for name, _, _ in self.input_specs()]


def is_adapter_input(name: str) -> bool:
    return name.endswith((f".{LORA_A}", f".{LORA_B}"))
