"""Cohere (Command R)'s config: attention and the MLP in parallel off one LayerNorm, LayerNorms
(mean-subtracting, weight only, float32), interleaved rope, logits times `logit_scale`, and
optional per-head q/k LayerNorms (`use_qk_norm`). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neffkit.models.config import common_fields
from neffkit.models.llama.config import LlamaConfig


@dataclass(frozen=True)
class CohereConfig(LlamaConfig):
    logit_scale: float = 1.0
    layer_norm_eps: float = 1e-5

    @classmethod
    def from_hf(cls, raw: dict[str, Any], path: Path) -> CohereConfig:
        fields = common_fields(raw, path)
        fields["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", True))
        return cls(
            **fields,
            qk_norm=bool(raw.get("use_qk_norm", False)),
            logit_scale=float(raw.get("logit_scale", 0.0625)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
        )
