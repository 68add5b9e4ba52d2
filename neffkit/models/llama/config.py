"""The dense Llama family's config: Llama, Mistral (a window on every layer), Qwen2 (qkv biases,
read from the checkpoint), Qwen3 (per-head q/k RMSNorm). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neffkit.models.config import ModelConfig, common_fields

QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # per-head RMSNorm on q and k before RoPE
# a `sliding_window` on every layer when set (no layer_types in their configs)
UNIFORM_WINDOW = ("MistralForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    qk_norm: bool = False

    @classmethod
    def from_hf(cls, raw: dict[str, Any], path: Path) -> LlamaConfig:
        return cls(**llama_fields(raw, path))


def llama_fields(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """The dense family's fields: the common ones, its window rule and q/k norm."""
    arch = (raw.get("architectures") or [""])[0]
    fields = common_fields(raw, path, uniform_window=arch in UNIFORM_WINDOW)
    return {**fields, "qk_norm": arch in QK_NORM}
