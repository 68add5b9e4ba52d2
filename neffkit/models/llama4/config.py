"""Llama 4 (text)'s config: the MoE family with Meta's attention pattern. Pure Python.

What differs from Mixtral, as transformers computes it (`Llama4ForCausalLM`):
- MoE on the layers `moe_layers` lists (or every `interleave_moe_layer_step`-th), the others a
  dense MLP of `intermediate_size_mlp`; a sparse layer's router takes the top-k logits through
  a sigmoid, scales each chosen expert's *input* by it, and adds a shared expert that every
  token runs (the experts' and shared expert's size is `intermediate_size`);
- RoPE on interleaved pairs, and only on the layers `no_rope_layers` marks 1; the others
  (NoPE) attend over the whole context with their queries scaled by
  1 + attn_scale * log1p(floor((position + 1) / floor_scale)) (`attn_temperature_tuning`);
- the RoPE layers attend within chunks of `attention_chunk_size` tokens (`chunked_attention`)
  and L2-normalise q and k after the rotation (`use_qk_norm`, no weight).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from neffkit.errors import ModelError
from neffkit.models.config import ACTIVATIONS, MODELS_DOC, FieldRules
from neffkit.models.llama.config import llama_fields
from neffkit.models.moe.config import MoeConfig
from neffkit.models.parallel import Parallelism

CHUNKED, FULL = "chunked_attention", "full_attention"
# HF's Llama4TextConfig defaults where a config.json leaves a field out
DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-5, "rope_theta": 500000.0}


@dataclass(frozen=True)
class Llama4Config(MoeConfig):
    attention_chunk_size: int | None = None
    chunked_layers: tuple[bool, ...] = ()  # chunked_layers[i]: layer i attends within chunks
    rope_layers: tuple[bool, ...] = ()  # rope_layers[i]: layer i rotates q and k (else NoPE)
    l2_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1

    # fp8 Llama 4 checkpoints quantize the fused expert tensors, which the shards do not cut
    RULES: ClassVar[FieldRules] = {"hidden_act": ACTIVATIONS, "quantization_config": ()}

    def check_parallelism(self, par: Parallelism) -> None:
        super().check_parallelism(par)
        if any(self.sparse_layers) and self.moe_intermediate_size % par.tp:
            raise ModelError(
                field="parallel.tp",
                message=f"{par.tp} does not divide the shared expert's intermediate size "
                f"{self.moe_intermediate_size}",
            )

    @classmethod
    def from_hf(cls, raw: dict[str, Any], path: Path) -> Llama4Config:
        raw = {**raw, **{k: v for k, v in DEFAULTS.items() if raw.get(k) is None}}
        layers = int(raw["num_hidden_layers"])
        rope_layers = tuple(
            bool(v)
            for v in raw.get("no_rope_layers")
            or [(i + 1) % int(raw.get("no_rope_layer_interval", 4)) != 0 for i in range(layers)]
        )
        chunk = raw.get("attention_chunk_size", 8192)
        layer_types = raw.get("layer_types") or [
            CHUNKED if rope and chunk is not None else FULL for rope in rope_layers
        ]
        _check_layers(path, layers, rope_layers, layer_types, chunk)
        fields = llama_fields({**raw, "layer_types": None}, path)
        step = int(raw.get("interleave_moe_layer_step", 1))
        moe_layers = raw.get("moe_layers")
        if moe_layers is None:
            moe_layers = range(step - 1, layers, step)
        return cls(
            **{**fields, "intermediate_size": int(raw.get("intermediate_size_mlp", 16384))},
            num_experts=int(raw.get("num_local_experts", 16)),
            experts_per_token=int(raw.get("num_experts_per_tok", 1)),
            moe_intermediate_size=int(raw["intermediate_size"]),
            sparse_layers=tuple(i in set(moe_layers) for i in range(layers)),
            attention_chunk_size=int(chunk) if chunk is not None else None,
            chunked_layers=tuple(t == CHUNKED for t in layer_types),
            rope_layers=rope_layers,
            l2_qk_norm=bool(raw.get("use_qk_norm", True)),
            attn_temperature_tuning=bool(raw.get("attn_temperature_tuning", True)),
            floor_scale=int(raw.get("floor_scale", 8192)),
            attn_scale=float(raw.get("attn_scale", 0.1)),
        )


def _check_layers(
    path: Path, layers: int, rope_layers: tuple[bool, ...], layer_types: list[str], chunk: Any
) -> None:
    """layer_types and no_rope_layers as HF's Llama 4 reads them, or a ModelError naming them."""
    for field, values in (("no_rope_layers", rope_layers), ("layer_types", layer_types)):
        if len(values) != layers:
            raise ModelError(f"{path}: {field} has {len(values)} entries for {layers} layers")
    unknown = sorted(set(layer_types) - {CHUNKED, FULL})
    if unknown:
        raise ModelError(
            f"{path}: layer_types = {unknown[0]!r} is not implemented for Llama4ForCausalLM; "
            f"implemented: {CHUNKED!r}, {FULL!r}",
            hint=f"what each family implements: {MODELS_DOC}",
        )
    if CHUNKED in layer_types and chunk is None:
        raise ModelError(
            f"{path}: layer_types has chunked_attention but attention_chunk_size is null"
        )
