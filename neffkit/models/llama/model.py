"""The dense Llama family's graph and sharding rules: the base decoder's parts as they are
(pre-norm RMSNorm, GQA with RoPE and optional biases, SwiGLU), plus Qwen3's per-head q/k RMSNorm
before RoPE."""

from __future__ import annotations

import torch

from neffkit.models.decoder import DecoderGraph
from neffkit.models.llama.config import LlamaConfig
from neffkit.models.shards import Named, Shards


class LlamaGraph(DecoderGraph):
    cfg: LlamaConfig

    def qk_norm(
        self, q: torch.Tensor, k: torch.Tensor, w: dict[str, torch.Tensor], p: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.cfg.qk_norm:
            return q, k
        return (
            self.norm(q, w[f"{p}.self_attn.q_norm.weight"]),
            self.norm(k, w[f"{p}.self_attn.k_norm.weight"]),
        )


class LlamaShards(Shards):
    cfg: LlamaConfig

    def attention_extras(self, p: str) -> Named:
        if self.cfg.qk_norm:
            yield f"{p}.self_attn.q_norm.weight", self.need(f"{p}.self_attn.q_norm.weight")
            yield f"{p}.self_attn.k_norm.weight", self.need(f"{p}.self_attn.k_norm.weight")
