"""Llama 4 (text)'s graph and shards over the MoE family's (config.py says what differs).

The chunked layers keep the whole context in their cache, as the sliding layers of other
families do; a chunk's queries see only its keys (the mask), so a block allocator could free a
chunked layer's blocks once their chunk is behind every sequence, which this layout does not do.

Sharding: HF stores each sparse layer's experts fused, `experts.gate_up_proj` [E, hidden, 2*I]
and `experts.down_proj` [E, I, hidden] (inputs first, unlike nn.Linear); they are cut and
transposed into the MoE family's `moe.gate_up` / `moe.down` layout. The shared expert splits
over every tp rank like the dense MLP.
"""

from __future__ import annotations

import torch

from neffkit.kernels.rope import apply_rope_interleaved
from neffkit.models.experts import Routing
from neffkit.models.llama4.config import Llama4Config
from neffkit.models.moe.model import MoeGraph, MoeShards, W
from neffkit.models.shards import Named
from neffkit.models.step import Span, Step


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32, without a weight (HF's Llama4TextL2Norm)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Graph(MoeGraph):
    cfg: Llama4Config
    rotary = staticmethod(apply_rope_interleaved)
    scales_expert_inputs = True

    def span(self, layer: int) -> Span:
        return None, self.cfg.attention_chunk_size if self.cfg.chunked_layers[layer] else None

    offsets_follow_rope = False  # NoPE layers and L2 norms: offsets built per layer

    def positional(
        self, q: torch.Tensor, k: torch.Tensor, layer: int, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE then L2 norms on the RoPE layers; on NoPE layers, temperature-tuned queries."""
        cfg = self.cfg
        if cfg.rope_layers[layer]:
            q, k = super().positional(q, k, layer, step)
            if cfg.l2_qk_norm:
                q, k = l2_norm(q, cfg.rms_norm_eps), l2_norm(k, cfg.rms_norm_eps)
            return q, k
        if cfg.attn_temperature_tuning:
            q = (q * self.temperature(step.positions)).to(q.dtype)
        return q, k

    def temperature(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, T, 1, 1] float32: 1 + attn_scale * log1p(floor((p + 1) / floor_scale)), the
        floor in integers (positions are >= 0; floor through float64 Trainium lacks)."""
        cfg = self.cfg
        steps = torch.div(positions + 1, cfg.floor_scale, rounding_mode="trunc").float()
        return (torch.log1p(steps) * cfg.attn_scale + 1.0)[..., None, None]

    def feed_forward(self, x: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        p = f"model.layers.{layer}"
        if self.cfg.sparse_layers[layer]:
            return self.reduce(self.moe(x, step, p), None)
        return self.reduce(self.mlp(x, step.w, f"{p}.feed_forward"), None)

    def route(self, x2: torch.Tensor, w: W, p: str) -> Routing:
        """Top-k router logits, each through a sigmoid (in float32, cast back)."""
        logits = x2 @ w[f"{p}.moe.router"].t()  # [N, E]
        top_v, top_i = torch.topk(logits, self.cfg.experts_per_token, dim=-1)
        return Routing(top_i, torch.sigmoid(top_v.float()).to(x2.dtype))

    def shared(self, routed: torch.Tensor, x: torch.Tensor, w: W, p: str) -> torch.Tensor:
        return routed + self.mlp(x, w, f"{p}.moe.shared")


class Llama4Shards(MoeShards):
    cfg: Llama4Config

    def feed_forward(self, layer: int, p: str) -> Named:
        if self.cfg.sparse_layers[layer]:
            yield from self.experts(p)
            return
        f = f"{p}.feed_forward"
        yield from self.column(f"{f}.gate_proj", self.i0, self.inter)
        yield from self.column(f"{f}.up_proj", self.i0, self.inter)
        yield from self.row(f"{f}.down_proj", self.i0, self.inter)

    def experts(self, p: str) -> Named:
        cfg, par, rank = self.cfg, self.par, self.rank
        local = cfg.num_experts // par.ep
        mine = slice((rank // par.moe_tp) * local, (rank // par.moe_tp + 1) * local)
        full, inter = cfg.moe_intermediate_size, cfg.moe_intermediate_size // par.moe_tp
        j0 = (rank % par.moe_tp) * inter
        f = f"{p}.feed_forward"
        gate_up = self.need(f"{f}.experts.gate_up_proj")[mine]  # [E_local, hidden, 2*I]
        gate, up = gate_up[..., j0 : j0 + inter], gate_up[..., full + j0 : full + j0 + inter]
        down = self.need(f"{f}.experts.down_proj")[mine, j0 : j0 + inter]  # [E_local, I, hidden]
        yield f"{p}.moe.router", self.need(f"{f}.router.weight")
        yield f"{p}.moe.gate_up", torch.cat((gate, up), -1).transpose(1, 2).contiguous()
        yield f"{p}.moe.down", down.transpose(1, 2).contiguous()  # [E_local, hidden, I_local]
        yield from self.shared_experts(f"{f}.shared_expert", f"{p}.moe.shared", full)
