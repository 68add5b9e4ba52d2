"""Gemma 2 and Gemma 3 (text) configs: the dense family with Gemma's scalings. Pure Python.

What differs from Llama, as transformers computes it: the embedding scaled by sqrt(hidden_size),
RMSNorm as x * (1 + w) in float32, norms after attention and after the MLP as well as before,
the attention scale query_pre_attn_scalar**-0.5, gelu-tanh (`hidden_activation`), tanh
soft-capping of the attention scores and the logits (Gemma 2), alternating sliding/full layers,
and in Gemma 3 per-head q/k norms and its own rope for the sliding layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from neffkit.models.config import (
    ACTIVATIONS,
    FieldRules,
    common_fields,
    frozen_rope,
    rope_parameters,
)
from neffkit.models.llama.config import LlamaConfig

GENERATIONS = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 3}
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    generation: int = 3
    embed_scale: float = 1.0  # sqrt(hidden_size)
    query_pre_attn_scalar: float = 1.0  # the attention scale is its inverse square root
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # the sliding layers' rope parameters (Gemma 3: rope_parameters.sliding_attention); () when
    # every layer rotates alike
    local_rope: tuple[tuple[str, Any], ...] = ()

    # HF's Gemma classes read hidden_activation (not hidden_act) and Gemma 3's attention mask
    RULES: ClassVar[FieldRules] = {
        "hidden_activation": ACTIVATIONS,
        "use_bidirectional_attention": (False,),
    }

    @property
    def local_rope_params(self) -> dict[str, Any] | None:
        return dict(self.local_rope) if self.local_rope else None

    @classmethod
    def from_hf(cls, raw: dict[str, Any], path: Path) -> GemmaConfig:
        arch = (raw.get("architectures") or [""])[0]
        generation = GENERATIONS[arch]
        layers = int(raw["num_hidden_layers"])
        full, local = _ropes(raw, generation)
        read = {**raw, "rope_parameters": full, "layer_types": _layer_types(raw, layers)}
        read.pop("rope_scaling", None)
        fields = common_fields(read, path)
        local_params = (
            rope_parameters({**raw, "rope_parameters": local}, str(path)) if local else None
        )
        return cls(
            **{**fields, "hidden_act": str(raw.get("hidden_activation") or "gelu_pytorch_tanh")},
            qk_norm=generation == 3,
            generation=generation,
            embed_scale=float(raw["hidden_size"]) ** 0.5,
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 256),
            attn_softcap=_cap(raw.get("attn_logit_softcapping")),
            final_softcap=_cap(raw.get("final_logit_softcapping")),
            local_rope=frozen_rope(local_params) if local_params else (),
        )


def _cap(value: Any) -> float | None:
    return float(value) if value else None


def _ropes(raw: dict[str, Any], generation: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the full layers' rope parameters, the sliding layers' or None when the same): 5.x nests
    them by layer type; 4.x Gemma 3 gives rope_scaling for the full layers and
    rope_local_base_freq for the sliding ones."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:
        return dict(params[FULL]), dict(params[SLIDING]) if params.get(SLIDING) else None
    theta = raw.get("rope_theta", 10000.0)
    full = dict(params or raw.get("rope_scaling") or {"rope_type": "default"})
    full.setdefault("rope_theta", theta)
    if generation == 3:
        local_theta = raw.get("rope_local_base_freq", 10000.0)
        return full, {"rope_type": "default", "rope_theta": local_theta}
    return full, None


def _layer_types(raw: dict[str, Any], layers: int) -> list[str]:
    """layer_types as HF derives them when a config leaves them out: Gemma 2 alternates from a
    sliding first layer, Gemma 3 slides on all but every `sliding_window_pattern`-th."""
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    if GENERATIONS[(raw.get("architectures") or [""])[0]] == 2:
        return [SLIDING if i % 2 == 0 else FULL for i in range(layers)]
    pattern = int(raw.get("sliding_window_pattern") or 6)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
