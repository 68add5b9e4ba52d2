"""Mixture-of-experts configs: the fields every MoE family has (GPT-OSS and DeepSeek-V3 build on
them too), read as HF computes them for Mixtral (every layer, renormalised top-k) and Qwen3-MoE
(`decoder_sparse_step`, `mlp_only_layers`, `norm_topk_prob`). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neffkit.errors import ModelError
from neffkit.models.llama.config import LlamaConfig, llama_fields
from neffkit.models.parallel import Parallelism


@dataclass(frozen=True)
class MoeConfig(LlamaConfig):
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[bool, ...] = ()  # sparse_layers[i]: layer i uses the MoE block
    # (the routing weights' dtype: Mixtral keeps HF's float32 softmax, Qwen3-MoE casts them)
    routing_float32: bool = False

    @property
    def is_moe(self) -> bool:
        return True

    @property
    def dense_layers(self) -> bool:
        """Some layer runs the dense MLP (its intermediate_size is then split over tp)."""
        return not all(self.sparse_layers)

    def check_parallelism(self, par: Parallelism) -> None:
        super().check_parallelism(par)
        if self.num_experts % par.ep:
            raise ModelError(
                field="parallel.ep",
                message=f"{par.ep} does not divide the model's {self.num_experts} experts",
            )
        if self.moe_intermediate_size % par.moe_tp:
            raise ModelError(
                field="parallel",
                message=f"tp/ep = {par.moe_tp} does not divide the experts' "
                f"intermediate size {self.moe_intermediate_size}",
            )

    @classmethod
    def from_hf(cls, raw: dict[str, Any], path: Path) -> MoeConfig:
        fields = llama_fields(raw, path)
        layers = fields["num_layers"]
        experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        if fields["architecture"] == "MixtralForCausalLM":
            sparse = (True,) * layers
            inter, norm = int(raw["intermediate_size"]), True
        else:
            step = int(raw.get("decoder_sparse_step") or 1)
            dense_only = set(raw.get("mlp_only_layers") or [])
            sparse = tuple(
                i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(layers)
            )
            inter, norm = int(raw["moe_intermediate_size"]), bool(raw.get("norm_topk_prob", False))
        return cls(
            **fields,
            num_experts=experts,
            experts_per_token=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=inter,
            norm_topk_prob=norm,
            sparse_layers=sparse,
            routing_float32=fields["architecture"] == "MixtralForCausalLM",
        )
