"""A GGUF file as a checkpoint source, its tensors kept at their width (filled by the GGUF work)."""

from __future__ import annotations

from pathlib import Path

from neffkit.checkpoints.quantized import Source


def gguf_source(model_dir: Path) -> Source | None:
    """The GGUF file a model directory stands for (None: a safetensors checkpoint)."""
    return None
