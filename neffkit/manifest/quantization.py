"""`quantization:`: the manifest's weight quantization of a float checkpoint, and the opt-in
int8 activations of integer weights (llama.cpp's arithmetic, kernels/int8_blocks.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neffkit.errors import ManifestError
from neffkit.manifest.fields import describe, mapping, no_unknown
from neffkit.models.config import ModelConfig

WEIGHTS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)
ACTIVATIONS = ("int8",)
# checkpoint formats whose integer weights can take int8 activations (compressed-tensors W8A8
# already quantizes its rows per token; mxfp4 is GPT-OSS's experts, not projections)
INT_FORMATS = ("gguf", "awq", "gptq", "compressed-tensors")


@dataclass(frozen=True)
class WeightQuantization:
    """int8: symmetric per output channel; int4: symmetric per group of `group_size` inputs.
    Projections and the LM head (a tied embedding table with it), less `exclude`. `weights` ""
    keeps an integer checkpoint's own weights. `activations` "int8": every integer projection
    quantizes its input rows to int8 per block of 32 (kernels/int8_blocks.py)."""

    weights: str
    group_size: int = 0
    exclude: tuple[str, ...] = ()
    activations: str = ""

    @property
    def storage(self) -> str:
        """Storage.quantize's spelling ("": the checkpoint's weights as they are)."""
        if not self.weights:
            return ""
        return "int8" if self.weights == "int8" else f"int4:{self.group_size}"


def read_quantization(value: Any, cfg: ModelConfig, model: Path) -> WeightQuantization | None:
    if value is None:
        return None
    raw = mapping(value, "quantization")
    no_unknown(raw, ("weights", "group_size", "exclude", "activations"), "quantization")
    activations = _activations(raw.get("activations"), raw, cfg, model)
    if "weights" not in raw and activations:
        return WeightQuantization("", activations=activations)
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
            hint="leave quantization.weights out (quantization.activations alone is allowed), "
            "or start from the float checkpoint",
        )
    return WeightQuantization(str(weights), int(group or 0), tuple(exclude), activations)


def _activations(value: Any, raw: dict[str, Any], cfg: ModelConfig, model: Path) -> str:
    """`quantization.activations`: "" or "int8", refused where no integer weight would read it."""
    if value is None:
        return ""
    if value not in ACTIVATIONS:
        raise ManifestError(
            f"quantization.activations: {describe(value)} is not supported; supported: "
            f"{', '.join(ACTIVATIONS)}"
        )
    if "weights" in raw:
        return str(value)
    if cfg.weight_format in INT_FORMATS and not _is_w8a8(cfg):
        return str(value)
    kind = cfg.weight_format or ("fp8" if cfg.fp8_block else "float")
    detail = "already quantizes its rows per token (W8A8)" if _is_w8a8(cfg) else f"is {kind}"
    raise ManifestError(
        f"quantization.activations: int8 activations are for integer weights; {model} {detail}",
        hint="add quantization.weights (int8 or int4) for a float checkpoint, or leave "
        "quantization.activations out",
    )


def _is_w8a8(cfg: ModelConfig) -> bool:
    """A compressed-tensors `int-quantized` checkpoint: its rows are quantized per token."""
    options = dict(cfg.weight_format_options)
    return cfg.weight_format == "compressed-tensors" and options.get("format") == "int-quantized"
