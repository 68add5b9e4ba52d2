"""DeepSeek-V3's config: latent attention sizes and its routing. Pure Python.

`head_dim` is the rope part of a query/key head (qk_rope_head_dim), as HF's config has it in 5.x.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neffkit.errors import ModelError
from neffkit.models.config import common_fields
from neffkit.models.moe.config import MoeConfig
from neffkit.models.parallel import Parallelism


@dataclass(frozen=True)
class DeepseekV3Config(MoeConfig):
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: q_proj, no q LoRA
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    # routing: sigmoid scores, a selection-only bias, group-limited top-k, scaling
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # shared experts next to the routed ones
    # multi-token prediction layers (num_nextn_predict_layers), stored after the decoder's at
    # layer index num_layers; the target's graphs never read them (speculation.method mtp does)
    mtp_layers: int = 0
    mtp_sparse: bool = True  # the MTP layer's MLP is the routed experts (past first_k_dense)

    kv_kind = "mla"

    @property
    def kv_width(self) -> int:
        return self.kv_lora_rank + self.head_dim

    def check_parallelism(self, par: Parallelism) -> None:
        super().check_parallelism(par)
        if self.shared_intermediate_size % par.tp:
            raise ModelError(
                field="parallel.tp",
                message=f"{par.tp} does not divide the shared experts' intermediate size "
                f"{self.shared_intermediate_size}",
            )

    @classmethod
    def from_hf(cls, raw: dict[str, Any], path: Path) -> DeepseekV3Config:
        fields = common_fields(raw, path)
        layers = fields["num_layers"]
        first_dense = int(raw.get("first_k_dense_replace") or 0)
        inter = int(raw["moe_intermediate_size"])
        return cls(
            **{**fields, "head_dim": int(raw["qk_rope_head_dim"])},
            num_experts=int(raw["n_routed_experts"]),
            experts_per_token=int(raw["num_experts_per_tok"]),
            moe_intermediate_size=inter,
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            sparse_layers=tuple(i >= first_dense for i in range(layers)),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            q_lora_rank=int(raw.get("q_lora_rank") or 0),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            router_groups=int(raw.get("n_group") or 1),
            router_topk_groups=int(raw.get("topk_group") or 1),
            routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
            shared_intermediate_size=inter * int(raw.get("n_shared_experts") or 0),
            mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
            mtp_sparse=layers >= first_dense,
        )


MTP_ARCHITECTURE = "DeepseekV3MTP"  # neffkit's name for the MTP layer built as its own model


@dataclass(frozen=True)
class DeepseekV3MtpConfig(DeepseekV3Config):
    """DeepSeek-V3's first multi-token prediction layer as a one-layer model (vLLM's
    deepseek_mtp.py): its decoder block reads the checkpoint's layer `source_layer`, its inputs
    mix each token's embedding with the hidden state the target (or its own previous step)
    predicted the token from, and its own norm and head (`shared_head`) give the logits."""

    source_layer: int = 0


def mtp_config(target: DeepseekV3Config) -> DeepseekV3MtpConfig:
    """The MTP layer's config, from the target's (refused where the checkpoint has none)."""
    if target.mtp_layers < 1:
        raise ModelError(
            field="speculation.method",
            message="mtp needs a checkpoint with multi-token prediction layers "
            "(config.json's num_nextn_predict_layers is 0 or absent)",
            hint="use method ngram or draft",
        )
    fields = {f.name: getattr(target, f.name) for f in dataclasses.fields(target)}
    fields |= {
        "architecture": MTP_ARCHITECTURE,
        "num_layers": 1,
        "mtp_layers": 0,
        "sparse_layers": (target.mtp_sparse,),
        "source_layer": target.num_layers,
        "sliding_windows": (None,),
    }
    return DeepseekV3MtpConfig(**fields)
