"""Granite's graph: the dense Llama family's with its multipliers (config.py); its checkpoint
cuts as Llama's."""

from __future__ import annotations

import torch

from neffkit.models.granite.config import GraniteConfig
from neffkit.models.llama.model import LlamaGraph, LlamaShards
from neffkit.models.step import Step


class GraniteGraph(LlamaGraph):
    cfg: GraniteConfig

    def embed(
        self, ids: torch.Tensor, w: dict[str, torch.Tensor], rank: torch.Tensor | None
    ) -> torch.Tensor:
        return super().embed(ids, w, rank) * self.cfg.embedding_multiplier

    def attention_scale(self) -> float:
        return self.cfg.attention_multiplier

    def layer(self, h: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        p, w, r = f"model.layers.{layer}", step.w, self.cfg.residual_multiplier
        x = self.norm(h, w[f"{p}.input_layernorm.weight"])
        h = h + self.attention(x, layer, step) * r
        x = self.norm(h, w[f"{p}.post_attention_layernorm.weight"])
        return h + self.feed_forward(x, layer, step) * r

    def logits(
        self, x: torch.Tensor, head: torch.Tensor, rank: torch.Tensor | None
    ) -> torch.Tensor:
        return super().logits(x, head, rank) / self.cfg.logits_scaling


class GraniteShards(LlamaShards):
    cfg: GraniteConfig
