"""The manifest's `lora:` as the bundle records it: every adapted projection of every layer, its
whole shape and how tp splits it (contract/lora.py), from the model's config alone."""

from __future__ import annotations

from neffkit.contract.lora import LoraRecord, LoraTarget
from neffkit.manifest.lora import DENSE_MODULES, Lora
from neffkit.models.config import ModelConfig
from neffkit.models.parallel import Parallelism

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


def rank_spans(cfg: ModelConfig, par: Parallelism, module: str) -> tuple[tuple[int, int], ...]:
    """Each rank's (start, size) of a projection along its split dimension: the cut the base
    weight gets (models/shards.py: query heads and the MLP split evenly, KV heads split or
    replicated where tp exceeds them), so an adapter splits exactly as its projection."""
    if par.tp == 1:
        return ()
    d, spans = cfg.head_dim, []
    for rank in range(par.tp):
        heads, inter = cfg.num_heads // par.tp, cfg.intermediate_size // par.tp
        kv = (cfg.kv_head_start(par, rank) * d, cfg.kv_heads_per_rank(par) * d)
        by_module = {"k_proj": kv, "v_proj": kv, "gate_proj": (rank * inter, inter)}
        by_module |= {"up_proj": by_module["gate_proj"], "down_proj": by_module["gate_proj"]}
        spans.append(by_module.get(module, (rank * heads * d, heads * d)))  # q_proj, o_proj
    return tuple(spans)


def lora_record(lora: Lora, cfg: ModelConfig, dtype: str, par: Parallelism) -> LoraRecord:
    """Slots for every targeted projection, layer by layer, in the manifest's module order."""
    targets = []
    for layer in range(cfg.num_layers):
        for module in lora.targets:
            block = "self_attn" if module in ATTENTION else "mlp"
            n_in, n_out = projection_shape(cfg, module)
            prefix = f"model.layers.{layer}.{block}.{module}"
            split, spans = DENSE_MODULES[module], rank_spans(cfg, par, module)
            targets.append(LoraTarget(prefix, n_in, n_out, split, spans))
    return LoraRecord(lora.max_loras, lora.max_rank, lora.targets, dtype, tuple(targets))
