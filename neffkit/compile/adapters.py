"""The manifest's `lora:` as the bundle records it: every adapted projection of every layer, its
whole shape and how tp splits it (contract/lora.py), from the model's config alone."""

from __future__ import annotations

import torch

from neffkit.contract.lora import LoraRecord, LoraTarget
from neffkit.manifest.lora import DENSE_MODULES, Lora
from neffkit.models.config import ModelConfig
from neffkit.models.parallel import Parallelism
from neffkit.models.shards import Shards

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


def _no_tensors(name: str) -> torch.Tensor:
    raise AssertionError(f"{name}: the cuts are read from the config alone")


def rank_spans(cfg: ModelConfig, par: Parallelism, module: str) -> tuple[tuple[int, int], ...]:
    """Each rank's (start, size) of a projection along its split dimension: the cut the base
    weight gets (models/shards.py), so an adapter splits exactly as its projection."""
    if par.tp == 1:
        return ()
    spans = []
    for rank in range(par.tp):
        cut = Shards(cfg, par, rank, _no_tensors, set())
        by_module = {
            "q_proj": (cut.q0, cut.heads * cfg.head_dim),
            "k_proj": (cut.k0, cut.kv_rows),
            "v_proj": (cut.k0, cut.kv_rows),
            "o_proj": (cut.q0, cut.heads * cfg.head_dim),
        }
        spans.append(by_module.get(module, (cut.i0, cut.inter)))
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
