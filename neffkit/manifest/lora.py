"""`lora:`: adapter slots in every graph, so one bundle serves many fine-tunes of its base
(contract/lora.py says what the graphs take; docs/serving.md#adapters how they are served).
Targets default to every projection that can take an adapter: all of a dense model's, the
attention of a mixture of experts (adapters on experts are refused by name)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neffkit.errors import ManifestError
from neffkit.manifest.fields import describe, mapping, no_unknown, positive_int, string_list
from neffkit.models.config import ModelConfig

MAX_LORAS = 64  # slots a graph reads every step: bytes grow with each
MAX_RANK = 256
# what tp splits: outputs (column) or inputs (row), as the base projections are split
DENSE_MODULES = {
    "q_proj": "column",
    "k_proj": "column",
    "v_proj": "column",
    "o_proj": "row",
    "gate_proj": "column",
    "up_proj": "column",
    "down_proj": "row",
}
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
# the architectures whose graphs add adapters, and the modules that can take one: every
# projection of the dense families; attention only where the MLP is a mixture of experts
LORA_ARCHITECTURES = {
    "LlamaForCausalLM": tuple(DENSE_MODULES),
    "MistralForCausalLM": tuple(DENSE_MODULES),
    "Qwen2ForCausalLM": tuple(DENSE_MODULES),
    "Qwen3ForCausalLM": tuple(DENSE_MODULES),
    "MixtralForCausalLM": ATTENTION_MODULES,
    "Qwen3MoeForCausalLM": ATTENTION_MODULES,
}


@dataclass(frozen=True)
class Lora:
    """Slots for `max_loras` adapters of rank up to `max_rank` on the `targets` modules."""

    max_loras: int
    max_rank: int
    targets: tuple[str, ...]


def read_lora(value: Any, cfg: ModelConfig) -> Lora | None:
    if value is None:
        return None
    raw = mapping(value, "lora")
    no_unknown(raw, ("max_loras", "max_rank", "targets"), "lora")
    max_loras = positive_int(raw.get("max_loras", 4), "lora.max_loras")
    max_rank = positive_int(raw.get("max_rank", 16), "lora.max_rank")
    if max_loras > MAX_LORAS:
        raise ManifestError(f"lora.max_loras: {max_loras} is above the limit of {MAX_LORAS}")
    if max_rank > MAX_RANK:
        raise ManifestError(f"lora.max_rank: {max_rank} is above the limit of {MAX_RANK}")
    available = LORA_ARCHITECTURES.get(cfg.architecture)
    if available is None:
        raise ManifestError(
            f"lora: adapters are not supported for {cfg.architecture} yet; supported: "
            f"{', '.join(LORA_ARCHITECTURES)}",
            hint="leave the lora section out of this manifest",
        )
    targets = available
    if "targets" in raw:
        targets = string_list(raw["targets"], "lora.targets")
        if not targets:
            raise ManifestError("lora.targets: expected at least one module name, got []")
        for i, module in enumerate(targets):
            _check_target(module, f"lora.targets[{i}]", available, cfg.architecture)
        if len(set(targets)) != len(targets):
            raise ManifestError(f"lora.targets: {list(targets)} names a module twice")
    return Lora(max_loras, max_rank, targets)


def _check_target(module: Any, field: str, available: tuple[str, ...], arch: str) -> None:
    if module in available:
        return
    if module in DENSE_MODULES:  # an MLP projection of a mixture of experts
        raise ManifestError(
            f"{field}: {module!r} is an expert projection of {arch}; adapters on MoE experts are "
            f"not supported (attention only: {', '.join(available)})"
        )
    raise ManifestError(
        f"{field}: {describe(module)} is not a projection of {arch}; available: "
        f"{', '.join(available)}"
    )
