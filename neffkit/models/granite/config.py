"""Granite's config: Llama with four multipliers, read as transformers' Granite class uses them
(`embedding_multiplier` on the embedding, `attention_multiplier` as the attention scale,
`residual_multiplier` on each branch before it is added, logits divided by `logits_scaling`).
Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neffkit.models.llama.config import LlamaConfig, llama_fields


@dataclass(frozen=True)
class GraniteConfig(LlamaConfig):
    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @classmethod
    def from_hf(cls, raw: dict[str, Any], path: Path) -> GraniteConfig:
        return cls(
            **llama_fields(raw, path),
            embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
            attention_multiplier=float(raw.get("attention_multiplier", 1.0)),
            residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
            logits_scaling=float(raw.get("logits_scaling", 1.0)),
        )
