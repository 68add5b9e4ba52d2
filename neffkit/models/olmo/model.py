"""OLMo and OLMo 2 graphs and shards (the norms config.py describes)."""

from __future__ import annotations

import torch

from neffkit.kernels.norm import rms_norm
from neffkit.models.llama.model import LlamaGraph, LlamaShards
from neffkit.models.olmo.config import OlmoConfig
from neffkit.models.shards import Named
from neffkit.models.step import Step

OLMO_LAYER_NORM_EPS = 1e-5  # HF's OlmoLayerNorm fixes it


class OlmoGraph(LlamaGraph):
    cfg: OlmoConfig

    def layer(self, h: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        if not self.cfg.olmo2:  # pre-norm, the norms without weights
            h = h + self.attention(self.norm(h, None), layer, step)
            return h + self.feed_forward(self.norm(h, None), layer, step)
        p, w = f"model.layers.{layer}", step.w
        h = h + self.norm(self.attention(h, layer, step), w[f"{p}.post_attention_layernorm.weight"])
        x = self.feed_forward(h, layer, step)
        return h + self.norm(x, w[f"{p}.post_feedforward_layernorm.weight"])

    def norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if self.cfg.olmo2:  # RMSNorm, the weight applied in float32
            assert weight is not None  # OLMo 2's norms all have weights
            return rms_norm(x, weight, self.cfg.rms_norm_eps, weight_in_float32=True)
        # OLMo: a LayerNorm without weight or bias, in float32
        shape = (x.shape[-1],)
        return torch.nn.functional.layer_norm(x.float(), shape, eps=OLMO_LAYER_NORM_EPS).to(x.dtype)

    def final_norm(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.norm(x, w.get("model.norm.weight"))  # OLMo: no weight (OlmoShards)

    def qk_norm(
        self, q: torch.Tensor, k: torch.Tensor, w: dict[str, torch.Tensor], p: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.cfg.olmo2:
            return q, k
        return (
            self._whole_norm(q, w[f"{p}.self_attn.q_norm.weight"]),
            self._whole_norm(k, w[f"{p}.self_attn.k_norm.weight"]),
        )

    def _whole_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over every head of the projection; under tp each rank holds some heads, so
        the sum of squares is all-reduced before the mean."""
        rows, tokens, heads, dim = x.shape
        flat = x.reshape(rows, tokens, heads * dim).float()
        squares = self.reduce(flat.pow(2).sum(-1, keepdim=True), None)
        width = heads * dim * self.par.tp
        normed = flat * torch.rsqrt(squares / width + self.cfg.rms_norm_eps)
        return (weight.float() * normed).to(x.dtype).reshape(rows, tokens, heads, dim)

    def linears(
        self, x: torch.Tensor, w: dict[str, torch.Tensor], prefixes: tuple[str, ...]
    ) -> list[torch.Tensor]:
        outs = super().linears(x, w, prefixes)
        clip = self.cfg.clip_qkv
        if clip is None:
            return outs
        qkv = (p.endswith(("q_proj", "k_proj", "v_proj")) for p in prefixes)
        return [o.clamp(-clip, clip) if c else o for o, c in zip(outs, qkv, strict=True)]


class OlmoShards(LlamaShards):
    cfg: OlmoConfig

    @property
    def final_norm(self) -> bool:
        return self.cfg.olmo2  # OLMo's final LayerNorm has no weight either

    def layer(self, layer: int) -> Named:
        p = f"model.layers.{layer}"
        if not self.cfg.olmo2:  # weightless norms: nothing to read but the projections
            yield from self.attention(p)
            yield from self.kv_scale_tensors(p)
            yield from self.feed_forward(layer, p)
            return
        yield from self.attention(p)
        yield from self.kv_scale_tensors(p)
        yield from self.column(f"{p}.self_attn.q_norm", self.q0, self.heads * self.cfg.head_dim)
        yield from self.column(f"{p}.self_attn.k_norm", self.k0, self.kv_rows)
        yield (
            f"{p}.post_attention_layernorm.weight",
            self.need(f"{p}.post_attention_layernorm.weight"),
        )
        yield from self.feed_forward(layer, p)
        yield (
            f"{p}.post_feedforward_layernorm.weight",
            self.need(f"{p}.post_feedforward_layernorm.weight"),
        )
