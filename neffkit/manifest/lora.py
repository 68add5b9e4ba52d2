"""`lora:`: adapter slots in every graph, so one bundle serves many fine-tunes of its base
(contract/lora.py says what the graphs take; docs/serving.md#adapters how they are served)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neffkit.errors import ManifestError
from neffkit.manifest.fields import describe, mapping, no_unknown, positive_int, string_list
from neffkit.models.config import ModelConfig
from neffkit.models.parallel import Parallelism

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
# the architectures whose every projection takes an adapter (their graphs are the base decoder's)
LORA_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class Lora:
    """Slots for `max_loras` adapters of rank up to `max_rank` on the `targets` modules."""

    max_loras: int
    max_rank: int
    targets: tuple[str, ...]


def read_lora(value: Any, cfg: ModelConfig, parallel: Parallelism) -> Lora | None:
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
    if cfg.architecture not in LORA_ARCHITECTURES:
        raise ManifestError(
            f"lora: adapters are not supported for {cfg.architecture} yet; supported: "
            f"{', '.join(LORA_ARCHITECTURES)}",
            hint="leave the lora section out of this manifest",
        )
    if parallel.tp > 1:
        raise ManifestError(
            f"lora: adapters are served at parallel.tp 1 for now; this manifest has tp "
            f"{parallel.tp}",
            hint="build the adapter bundle with tp 1",
        )
    targets = tuple(DENSE_MODULES)
    if "targets" in raw:
        targets = string_list(raw["targets"], "lora.targets")
        if not targets:
            raise ManifestError("lora.targets: expected at least one module name, got []")
        for i, module in enumerate(targets):
            if module not in DENSE_MODULES:
                raise ManifestError(
                    f"lora.targets[{i}]: {describe(module)} is not a projection of "
                    f"{cfg.architecture}; available: {', '.join(DENSE_MODULES)}"
                )
        if len(set(targets)) != len(targets):
            raise ManifestError(f"lora.targets: {list(targets)} names a module twice")
    return Lora(max_loras, max_rank, targets)
