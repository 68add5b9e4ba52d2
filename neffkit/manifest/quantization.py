"""`quantization:`: the manifest's weight quantization of a float checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neffkit.errors import ManifestError
from neffkit.manifest.fields import describe, mapping, no_unknown
from neffkit.models.config import ModelConfig

WEIGHTS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class WeightQuantization:
    """int8: symmetric per output channel; int4: symmetric per group of `group_size` inputs.
    Projections and the LM head (a tied embedding table with it), less `exclude`."""

    weights: str
    group_size: int = 0
    exclude: tuple[str, ...] = ()

    @property
    def storage(self) -> str:
        """Storage.quantize's spelling."""
        return "int8" if self.weights == "int8" else f"int4:{self.group_size}"


def read_quantization(value: Any, cfg: ModelConfig, model: Path) -> WeightQuantization | None:
    if value is None:
        return None
    raw = mapping(value, "quantization")
    no_unknown(raw, ("weights", "group_size", "exclude"), "quantization")
    weights = raw.get("weights")
    if weights not in WEIGHTS:
        raise ManifestError(
            f"quantization.weights: {describe(weights)} is not supported; supported: "
            f"{', '.join(WEIGHTS)}"
        )
    group = raw.get("group_size")
    if weights == "int8" and group is not None:
        raise ManifestError(
            "quantization.group_size: int8 is per output channel (no groups)",
            hint="leave group_size out, or use weights: int4",
        )
    if weights == "int4":
        if group is None:
            group = 128
        if group not in GROUP_SIZES:
            raise ManifestError(
                f"quantization.group_size: {describe(group)} is not supported; supported: "
                f"{', '.join(map(str, GROUP_SIZES))}"
            )
    exclude = raw.get("exclude", [])
    if not isinstance(exclude, list) or not all(isinstance(e, str) and e for e in exclude):
        raise ManifestError(
            f"quantization.exclude: expected a list of module names, got {describe(exclude)}"
        )
    if cfg.fp8_block or cfg.weight_format:
        kind = cfg.weight_format or "fp8"
        raise ManifestError(
            f"quantization: {model} is already quantized ({kind}); neffkit keeps a quantized "
            "checkpoint at its own width",
            hint="leave quantization out, or start from the float checkpoint",
        )
    return WeightQuantization(str(weights), int(group or 0), tuple(exclude))
