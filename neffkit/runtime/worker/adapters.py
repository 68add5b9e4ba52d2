"""A process's adapter slot tensors (contract/lora.py): persistent graph inputs it owns,
rewritten in place when an adapter takes a slot, so a new adapter is a copy, never a recompile.

The tensors are the ones bound to every graph; after writing one the executor is told
(`refresh`), so an executor that keeps its own device copy (XLA:CPU, Neuron) replaces it. A
process serves one rank, or every rank of an SPMD load (XLA:CPU); each rank gets its cut of the
adapter. `on_write` tells the other ranks' processes (worker/distributed.py) which adapter to
write where, so every rank's slots hold the same adapters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from neffkit.contract.lora import LORA_A, LORA_B, LoraRecord
from neffkit.runtime.lora.peft_adapter import Adapter, shard

# (name, every rank's tensor of that name, in the order the process holds the ranks)
Refresh = Callable[[str, list[torch.Tensor]], None]


def allocate_slots(lora: LoraRecord, tp: int, device: str) -> list[torch.Tensor]:
    """Zeroed slot tensors in graph input order: every slot holds the base (no delta)."""
    return [
        torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
        for _, shape, dtype in lora.input_specs(tp)
    ]


class AdapterSlots:
    """Writes adapters into the slots of the ranks this process holds. Slot numbers are the
    graphs' (1 .. max_loras); 0 is the base model and is never written."""

    def __init__(
        self,
        lora: LoraRecord,
        tensors_by_rank: dict[int, list[torch.Tensor]],
        refresh: Refresh,
        tp: int = 1,
    ) -> None:
        self.lora, self.tp, self.refresh = lora, tp, refresh
        names = lora.names()
        self.ranks = {
            rank: dict(zip(names, tensors, strict=True))
            for rank, tensors in tensors_by_rank.items()
        }
        # the leader's hook: the same write on the other ranks' processes
        self.on_write: Callable[[int, Adapter | None], None] | None = None

    def write(self, slot: int, adapter: Adapter | None) -> None:
        """`adapter` into `slot` (None: zeros); the prefixes it does not adapt are zeroed."""
        if not 1 <= slot <= self.lora.max_loras:
            raise ValueError(f"adapter slot {slot} is outside 1..{self.lora.max_loras}")
        if self.on_write is not None:
            self.on_write(slot, adapter)
        index = slot - 1
        for target in self.lora.targets:
            whole = adapter.weights.get(target.prefix) if adapter is not None else None
            a_name, b_name = f"{target.prefix}.{LORA_A}", f"{target.prefix}.{LORA_B}"
            for rank, tensors in self.ranks.items():
                a, b = tensors[a_name], tensors[b_name]
                if whole is None:
                    a[:, index].zero_()
                    b[index].zero_()
                else:
                    a_part, b_part = shard(*whole, target, rank, self.tp)
                    a[:, index].copy_(a_part)
                    b[index].copy_(b_part)
            for name in (a_name, b_name):
                self.refresh(name, [tensors[name] for tensors in self.ranks.values()])
