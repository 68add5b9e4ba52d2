"""GPT-OSS's config: an MoE model whose experts' SwiGLU is clamped. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from neffkit.errors import ModelError
from neffkit.models.config import FieldRules, common_fields
from neffkit.models.moe.config import MoeConfig


@dataclass(frozen=True)
class GptOssConfig(MoeConfig):
    # the experts' SwiGLU clamps (gate <= limit, |up| <= limit) and gates with
    # sigmoid(alpha * gate), then multiplies by (up + 1)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # HF's GptOss class reads no hidden_act: its experts' activation is the clamped SwiGLU
    RULES: ClassVar[FieldRules] = {}

    @classmethod
    def from_hf(cls, raw: dict[str, Any], path: Path) -> GptOssConfig:
        fields = {**common_fields(raw, path), "hidden_act": "silu"}
        if fields["fp8_block"]:
            raise ModelError(f"{path}: fp8 GPT-OSS checkpoints are not supported")
        layers = fields["num_layers"]
        return cls(
            **fields,
            num_experts=int(raw.get("num_local_experts") or raw.get("num_experts") or 0),
            experts_per_token=int(raw.get("num_experts_per_tok") or raw["experts_per_token"]),
            moe_intermediate_size=int(raw["intermediate_size"]),
            sparse_layers=(True,) * layers,
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        )
