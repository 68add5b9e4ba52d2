"""Quantized checkpoint formats read from safetensors (AWQ, GPTQ, compressed-tensors int,
mxfp4), each a `checkpoints.quantized.Format`; the config checks are models/quantization.py's."""

from __future__ import annotations

import importlib
from typing import Any

from neffkit.checkpoints.quantized import Format

# ModelConfig.weight_format → (module, class) of its reader
FORMATS = {
    "awq": ("awq", "AwqFormat"),
    "gptq": ("gptq", "GptqFormat"),
    "compressed-tensors": ("compressed", "CompressedTensorsFormat"),
    "mxfp4": ("mxfp4", "Mxfp4Format"),
}


def format_for(name: str, options: dict[str, Any]) -> Format | None:
    """The reader of a checkpoint's weight format ("" : unquantized or fp8, read as it is)."""
    if not name or name not in FORMATS:
        return None
    module, cls = FORMATS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(options)
