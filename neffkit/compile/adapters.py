"""The manifest's `lora:` as the bundle records it: every adapted projection of every layer, its
whole shape and how tp splits it (contract/lora.py), from the model's config alone."""

from __future__ import annotations

from neffkit.contract.lora import LoraRecord, LoraTarget
from neffkit.manifest.lora import DENSE_MODULES, Lora
from neffkit.models.config import ModelConfig

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def projection_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) of one dense projection, whole."""
    hidden, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, cfg.intermediate_size),
        "up_proj": (hidden, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, hidden),
    }
    return shapes[module]


def lora_record(lora: Lora, cfg: ModelConfig, dtype: str) -> LoraRecord:
    """Slots for every targeted projection, layer by layer, in the manifest's module order."""
    targets = []
    for layer in range(cfg.num_layers):
        for module in lora.targets:
            block = "self_attn" if module in ATTENTION else "mlp"
            n_in, n_out = projection_shape(cfg, module)
            prefix = f"model.layers.{layer}.{block}.{module}"
            targets.append(LoraTarget(prefix, n_in, n_out, DENSE_MODULES[module]))
    return LoraRecord(lora.max_loras, lora.max_rank, lora.targets, dtype, tuple(targets))
