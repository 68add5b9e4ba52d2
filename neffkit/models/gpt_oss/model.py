"""GPT-OSS's graph and sharding rules over the MoE family's: attention sinks, top-k-first
routing over biased logits, biased experts with a clamped SwiGLU, and an RMSNorm that multiplies
its weight in float32 before the cast back."""

from __future__ import annotations

import torch

from neffkit.kernels.norm import rms_norm
from neffkit.models.experts import Routing
from neffkit.models.gpt_oss.config import GptOssConfig
from neffkit.models.moe.model import MoeGraph, MoeShards, W
from neffkit.models.shards import Named


class GptOssGraph(MoeGraph):
    cfg: GptOssConfig

    def sinks(self, w: W, p: str) -> torch.Tensor:
        """A learned logit per query head in each softmax denominator."""
        return w[f"{p}.self_attn.sinks"]

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.cfg.rms_norm_eps, weight_in_float32=True)

    def route(self, x2: torch.Tensor, w: W, p: str) -> Routing:
        """Biased logits, top-k, then a softmax over the k."""
        logits = x2 @ w[f"{p}.moe.router"].t()  # [N, E]
        k = self.cfg.experts_per_token
        top_v, top_i = torch.topk(logits + w[f"{p}.moe.router_bias"], k, dim=-1)
        return Routing(top_i, torch.softmax(top_v, dim=-1))

    def expert_activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate <= limit, |up| <= limit, sigmoid(alpha * gate) and (up + 1)."""
        limit = self.cfg.swiglu_limit
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.cfg.swiglu_alpha))


class GptOssShards(MoeShards):
    cfg: GptOssConfig

    def attention_extras(self, p: str) -> Named:
        d = self.cfg.head_dim  # one sink per query head: this rank's heads
        first = self.q0 // d
        yield f"{p}.self_attn.sinks", self.need(f"{p}.self_attn.sinks")[first : first + self.heads]

    def experts(self, p: str) -> Named:
        """GPT-OSS's experts into the stacked layout: `gate_up_proj` [E, hidden, 2I] holds gate
        and up interleaved (even, odd columns), `down_proj` is [E, I, hidden]; both have biases.
        The down bias is added once per expert group: ranks other than the group's first hold
        zeros."""
        cfg, par, rank = self.cfg, self.par, self.rank
        local = cfg.num_experts // par.ep
        ep_rank, moe_rank = rank // par.moe_tp, rank % par.moe_tp
        inter = cfg.moe_intermediate_size // par.moe_tp
        j0, e0 = moe_rank * inter, ep_rank * local
        ex = f"{p}.mlp.experts"
        gu = self.need(f"{ex}.gate_up_proj")[e0 : e0 + local]  # [E_local, hidden, 2I]
        gate, up = gu[..., 0::2][..., j0 : j0 + inter], gu[..., 1::2][..., j0 : j0 + inter]
        bias = self.need(f"{ex}.gate_up_proj_bias")[e0 : e0 + local]  # [E_local, 2I]
        gate_b, up_b = bias[..., 0::2][..., j0 : j0 + inter], bias[..., 1::2][..., j0 : j0 + inter]
        down = self.need(f"{ex}.down_proj")[e0 : e0 + local, j0 : j0 + inter]  # [E_l, I_l, hidden]
        down_b = self.need(f"{ex}.down_proj_bias")[e0 : e0 + local]
        yield f"{p}.moe.router", self.need(f"{p}.mlp.router.weight")
        yield f"{p}.moe.router_bias", self.need(f"{p}.mlp.router.bias")
        yield f"{p}.moe.gate_up", torch.cat([gate, up], dim=-1).transpose(1, 2)
        yield f"{p}.moe.gate_up_bias", torch.cat([gate_b, up_b], dim=-1)  # [E_local, 2I_local]
        yield f"{p}.moe.down", down.transpose(1, 2)  # [E_local, hidden, I_local]
        yield f"{p}.moe.down_bias", down_b if moe_rank == 0 else torch.zeros_like(down_b)
