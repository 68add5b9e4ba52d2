"""One rank's adapter slot tensors (contract/lora.py): persistent graph inputs this rank owns,
rewritten in place when an adapter takes a slot, so a new adapter is a copy, never a recompile.

The tensors are the ones bound to every graph; after writing one the executor is told
(`refresh`), so an executor that keeps its own device copy (XLA:CPU, Neuron) replaces it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from neffkit.contract.lora import LORA_A, LORA_B, LoraRecord
from neffkit.runtime.lora.peft_adapter import Adapter, shard


def allocate_slots(lora: LoraRecord, tp: int, device: str) -> list[torch.Tensor]:
    """Zeroed slot tensors in graph input order: every slot holds the base (no delta)."""
    return [
        torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
        for _, shape, dtype in lora.input_specs(tp)
    ]


class AdapterSlots:
    """Writes adapters into this rank's slots. Slot numbers are the graphs' (1 .. max_loras);
    0 is the base model and is never written."""

    def __init__(
        self,
        lora: LoraRecord,
        tensors: list[torch.Tensor],
        refresh: Callable[[str, torch.Tensor], None],
        rank: int = 0,
        tp: int = 1,
    ) -> None:
        self.lora, self.rank, self.tp = lora, rank, tp
        self.tensors = dict(zip(lora.names(), tensors, strict=True))
        self.refresh = refresh  # the executor's: its copy of a written input is stale

    def write(self, slot: int, adapter: Adapter | None) -> None:
        """`adapter` into `slot` (None: zeros); the prefixes it does not adapt are zeroed."""
        if not 1 <= slot <= self.lora.max_loras:
            raise ValueError(f"adapter slot {slot} is outside 1..{self.lora.max_loras}")
        index = slot - 1
        for target in self.lora.targets:
            a_name, b_name = f"{target.prefix}.{LORA_A}", f"{target.prefix}.{LORA_B}"
            a, b = self.tensors[a_name], self.tensors[b_name]
            whole = adapter.weights.get(target.prefix) if adapter is not None else None
            if whole is None:
                a[:, index].zero_()
                b[index].zero_()
            else:
                a_part, b_part = shard(*whole, target, self.rank, self.tp)
                a[:, index].copy_(a_part)
                b[index].copy_(b_part)
            self.refresh(a_name, a)
            self.refresh(b_name, b)
