"""OLMo and OLMo 2 configs: the dense family with AI2's norms. Pure Python.

OLMo: pre-norm with a LayerNorm that has no weight or bias (eps 1e-5, in float32) and optional
`clip_qkv` clamping of q, k and v. OLMo 2: no norm before attention or the MLP, RMSNorms after
them (on the branch), and q/k RMSNorms over the whole projection (all heads at once), not per
head as Qwen3's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neffkit.errors import ModelError
from neffkit.models.config import common_fields
from neffkit.models.llama.config import LlamaConfig
from neffkit.models.parallel import Parallelism

OLMO2 = "Olmo2ForCausalLM"


@dataclass(frozen=True)
class OlmoConfig(LlamaConfig):
    olmo2: bool = False
    clip_qkv: float | None = None

    def check_parallelism(self, par: Parallelism) -> None:
        super().check_parallelism(par)
        if self.olmo2 and self.num_kv_heads % par.tp:
            # k_norm spans every KV head: replicated heads would count twice in its mean
            raise ModelError(
                field="parallel.tp",
                message=f"OLMo 2 normalises k over all {self.num_kv_heads} KV heads; "
                f"{par.tp} must divide them",
            )

    @classmethod
    def from_hf(cls, raw: dict[str, Any], path: Path) -> OlmoConfig:
        olmo2 = (raw.get("architectures") or [""])[0] == OLMO2
        clip = raw.get("clip_qkv")
        return cls(
            **common_fields(raw, path),
            olmo2=olmo2,
            clip_qkv=float(clip) if clip is not None and not olmo2 else None,
        )
