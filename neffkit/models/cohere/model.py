"""Cohere (Command R)'s graph and shards (the parts config.py lists)."""

from __future__ import annotations

import torch

from neffkit.kernels.rope import apply_rope_interleaved
from neffkit.models.cohere.config import CohereConfig
from neffkit.models.llama.model import LlamaGraph, LlamaShards
from neffkit.models.shards import Named
from neffkit.models.step import Step


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Cohere's LayerNorm: mean-subtracted, weight only, in float32, over the last dim."""
    h = x.float()
    centred = h - h.mean(-1, keepdim=True)
    h = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


class CohereGraph(LlamaGraph):
    cfg: CohereConfig
    rotary = staticmethod(apply_rope_interleaved)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, weight, self.cfg.layer_norm_eps)

    def layer(self, h: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        """Attention and the MLP side by side on one normed input, both added to h."""
        x = self.norm(h, step.w[f"model.layers.{layer}.input_layernorm.weight"])
        return h + self.attention(x, layer, step) + self.feed_forward(x, layer, step)

    def qk_norm(
        self, q: torch.Tensor, k: torch.Tensor, w: dict[str, torch.Tensor], p: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.cfg.qk_norm:  # per-head weights [heads, head_dim]: this rank's heads
            return q, k
        eps = self.cfg.layer_norm_eps
        return (
            layer_norm(q, w[f"{p}.self_attn.q_norm.weight"], eps),
            layer_norm(k, w[f"{p}.self_attn.k_norm.weight"], eps),
        )

    def logits(
        self, x: torch.Tensor, head: torch.Tensor, rank: torch.Tensor | None
    ) -> torch.Tensor:
        return super().logits(x, head, rank) * self.cfg.logit_scale


class CohereShards(LlamaShards):
    cfg: CohereConfig

    def attention_extras(self, p: str) -> Named:
        if self.cfg.qk_norm:
            heads, kv = self.heads, self.cfg.kv_heads_per_rank(self.par)
            h0, k0 = self.rank * heads, self.cfg.kv_head_start(self.par, self.rank)
            yield (
                f"{p}.self_attn.q_norm.weight",
                self.need(f"{p}.self_attn.q_norm.weight")[h0 : h0 + heads],
            )
            yield (
                f"{p}.self_attn.k_norm.weight",
                self.need(f"{p}.self_attn.k_norm.weight")[k0 : k0 + kv],
            )

    def feed_forward_norm(self, p: str) -> Named:
        return iter(())  # attention and the MLP share the input norm
