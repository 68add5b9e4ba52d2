"""Phi-3 / Phi-4's config: the dense Llama family with fused projections (cut apart at build
time, model.py), a `sliding_window` on every layer when set, and longrope ("su") scaling.
Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neffkit.errors import ModelError
from neffkit.models.config import common_fields
from neffkit.models.llama.config import LlamaConfig


@dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    @classmethod
    def from_hf(cls, raw: dict[str, Any], path: Path) -> Phi3Config:
        fields = common_fields(raw, path, uniform_window=True)
        if fields["fp8_block"]:  # the scales of a fused projection are not cut apart yet
            raise ModelError(
                f"{path}: quantization_config: fp8 Phi-3 checkpoints are not supported"
            )
        return cls(**fields)
