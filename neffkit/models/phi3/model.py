"""Phi-3 / Phi-4: Llama's graph over Phi's fused checkpoint. `qkv_proj` ([q; k; v] rows) and
`gate_up_proj` ([gate; up] rows) are cut into the q/k/v and gate/up projections the dense graph
reads, per rank, when the shards are written, so the graph is the dense family's."""

from __future__ import annotations

import torch

from neffkit.models.llama.model import LlamaGraph, LlamaShards
from neffkit.models.phi3.config import Phi3Config
from neffkit.models.shards import Named


class Phi3Graph(LlamaGraph):
    cfg: Phi3Config


class Phi3Shards(LlamaShards):
    cfg: Phi3Config

    def attention(self, p: str) -> Named:
        cfg = self.cfg
        qkv = self.need(f"{p}.self_attn.qkv_proj.weight")
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = torch.split(qkv, [q_rows, kv_rows, kv_rows])
        yield f"{p}.self_attn.q_proj.weight", q[self.q0 : self.q0 + self.heads * cfg.head_dim]
        yield f"{p}.self_attn.k_proj.weight", k[self.k0 : self.k0 + self.kv_rows]
        yield f"{p}.self_attn.v_proj.weight", v[self.k0 : self.k0 + self.kv_rows]
        yield from self.row(f"{p}.self_attn.o_proj", self.q0, self.heads * cfg.head_dim)

    def feed_forward(self, layer: int, p: str) -> Named:
        gate, up = self.need(f"{p}.mlp.gate_up_proj.weight").chunk(2, dim=0)
        yield f"{p}.mlp.gate_proj.weight", gate[self.i0 : self.i0 + self.inter]
        yield f"{p}.mlp.up_proj.weight", up[self.i0 : self.i0 + self.inter]
        yield from self.row(f"{p}.mlp.down_proj", self.i0, self.inter)
