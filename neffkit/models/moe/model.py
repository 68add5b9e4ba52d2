"""The MoE family's graph and sharding rules over the Llama family's: on sparse layers the MoE
block replaces the MLP; nothing else changes. GPT-OSS and DeepSeek-V3 override its routing, its
experts' activation and its shared experts.

The block runs top-k routed experts over this rank's experts (no all-to-all; models/experts.py).
Routing is HF's: softmax in float32, top-k, optional renormalisation. Decode graphs gather each
token's k experts when that reads fewer experts than running them all; prefill runs every local
expert densely. Partial sums of all ranks are added by the same all-reduce as the dense layers.

Sharding: the router is replicated; experts are split over `ep` groups of tp/ep ranks, and each
expert's intermediate dimension over the tp/ep ranks of its group. Each rank's experts are
stacked into `moe.gate_up` [E_local, 2*I_local, hidden] and `moe.down` [E_local, hidden, I_local].
"""

from __future__ import annotations

import torch

from neffkit.kernels.activation import gated
from neffkit.models.experts import Routing, dense_weights, gather_rows, local_slots
from neffkit.models.llama.model import LlamaGraph, LlamaShards
from neffkit.models.moe.config import MoeConfig
from neffkit.models.shards import Named
from neffkit.models.step import Step

W = dict[str, torch.Tensor]


class MoeGraph(LlamaGraph):
    cfg: MoeConfig
    # the routing weight scales each expert's input, not its output (Llama 4; an expert is not
    # linear, so the two differ); an expert then reads 0 where its weight is 0
    scales_expert_inputs = False

    def feed_forward(self, x: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        if not self.cfg.sparse_layers[layer]:
            return super().feed_forward(x, layer, step)
        return self.reduce(self.moe(x, step, f"model.layers.{layer}"), None)

    def moe(self, x: torch.Tensor, step: Step, p: str) -> torch.Tensor:
        """Top-k routed experts over this rank's experts, plus shared experts where the family
        has them."""
        w = step.w
        rows, tokens, hidden = x.shape
        x2 = x.reshape(-1, hidden)  # [N, hidden]
        routing = self.route(x2, w, p)
        local = w[f"{p}.moe.gate_up"].shape[0]  # [E_local, 2*I, hidden]
        first: torch.Tensor | int = 0
        if step.rank is not None:  # this rank's experts, chosen by a tensor: SPMD-identical
            # trunc (= floor: ranks are >= 0) stays in integers; floor lowers through float64,
            # which Trainium lacks
            first = torch.div(step.rank, self.par.moe_tp, rounding_mode="trunc") * local
        if self.routed(x2.shape[0], local):
            out = self.gathered_experts(x2, local_slots(routing, local, first), w, p)
        else:
            dense = dense_weights(routing, self.cfg.num_experts, first, local)  # [N, E_local]
            out = self.dense_experts(x2, dense, w, p)
        return self.shared(out.to(x.dtype).reshape(rows, tokens, hidden), x, w, p)

    def gathered_experts(self, x2: torch.Tensor, mine: Routing, w: W, p: str) -> torch.Tensor:
        """[N, hidden]: each token through its k routed experts only (their weights gathered)."""
        gate_up, down = w[f"{p}.moe.gate_up"], w[f"{p}.moe.down"]
        gate_up_b, down_b = w.get(f"{p}.moe.gate_up_bias"), w.get(f"{p}.moe.down_bias")
        reduce = self.projection.form(x2.shape[0], blocked=False) == "reduction"
        n, k, hidden = *mine.ids.shape, x2.shape[-1]
        if self.scales_expert_inputs:  # each of a token's k experts reads x * its weight
            xk = (x2.unsqueeze(1) * mine.weights.unsqueeze(-1).to(x2.dtype)).reshape(-1, hidden)
            h = gather_rows(xk, gate_up, mine.ids.reshape(-1, 1), reduce).reshape(n, k, -1)
        else:
            h = gather_rows(x2, gate_up, mine.ids, reduce)  # [N, k, 2*I]
        if gate_up_b is not None:
            h = h + gate_up_b[mine.ids]
        act = self.expert_activation(*h.chunk(2, dim=-1))  # [N, k, I]
        out = gather_rows(act.reshape(-1, act.shape[-1]), down, mine.ids.reshape(-1, 1), reduce)
        out = out.reshape(n, k, hidden)
        if down_b is not None:
            out = out + down_b[mine.ids]
        if self.scales_expert_inputs:  # weighted on the way in; others' slots read 0
            return out.sum(1)
        return (out.to(mine.weights.dtype) * mine.weights.unsqueeze(-1)).sum(1)

    def dense_experts(self, x2: torch.Tensor, dense: torch.Tensor, w: W, p: str) -> torch.Tensor:
        """[N, hidden]: every local expert on every token, weighted by `dense` [N, E_local]."""
        gate_up, down = w[f"{p}.moe.gate_up"], w[f"{p}.moe.down"]
        gate_up_b, down_b = w.get(f"{p}.moe.gate_up_bias"), w.get(f"{p}.moe.down_bias")
        if self.scales_expert_inputs:
            xe = x2.unsqueeze(0) * dense.t().unsqueeze(-1).to(x2.dtype)  # [E_local, N, hidden]
            h = torch.einsum("enh,eih->eni", xe, gate_up)  # [E_local, N, 2*I]
        else:
            h = torch.einsum("nh,eih->eni", x2, gate_up)  # [E_local, N, 2*I]
        if gate_up_b is not None:
            h = h + gate_up_b.unsqueeze(1)
        act = self.expert_activation(*h.chunk(2, dim=-1))  # [E_local, N, I]
        out = torch.einsum("eni,ehi->enh", act, down)  # [E_local, N, hidden]
        if down_b is not None:
            out = out + down_b.unsqueeze(1)
        if self.scales_expert_inputs:
            return out.sum(0)
        return torch.einsum("enh,ne->nh", out.to(dense.dtype), dense)

    def route(self, x2: torch.Tensor, w: W, p: str) -> Routing:
        """Each token's experts and weights: softmax in float32, top-k, optional
        renormalisation; Qwen3-MoE casts the weights to the activations' dtype, Mixtral keeps
        float32."""
        cfg = self.cfg
        logits = x2 @ w[f"{p}.moe.router"].t()  # [N, E]
        probs = torch.softmax(logits.float(), dim=-1)
        top_w, top_i = torch.topk(probs, cfg.experts_per_token, dim=-1)  # [N, k]
        if cfg.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        if not cfg.routing_float32:
            top_w = top_w.to(x2.dtype)
        return Routing(top_i, top_w)

    def expert_activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The experts' gated activation (the config's `hidden_act`, as the dense MLP's)."""
        return gated(self.cfg.hidden_act, gate, up)

    def shared(self, routed: torch.Tensor, x: torch.Tensor, w: W, p: str) -> torch.Tensor:
        """Experts every token runs beside the routed ones: none here (DeepSeek has them)."""
        return routed

    def routed(self, num_tokens: int, local: int) -> bool:
        """Gather the routed experts (decode) when that reads fewer than all local experts."""
        return self.shape.rule.one_token and num_tokens * self.cfg.experts_per_token < local


class MoeShards(LlamaShards):
    """Qwen3-MoE's names: `mlp.experts.{e}.{gate,up,down}_proj`, the router `mlp.gate`."""

    cfg: MoeConfig

    def feed_forward(self, layer: int, p: str) -> Named:
        if not self.cfg.sparse_layers[layer]:
            yield from super().feed_forward(layer, p)
            return
        yield from self.experts(p)

    def experts(self, p: str) -> Named:
        cfg, par, rank = self.cfg, self.par, self.rank
        local = cfg.num_experts // par.ep
        ep_rank, moe_rank = rank // par.moe_tp, rank % par.moe_tp
        inter = cfg.moe_intermediate_size // par.moe_tp
        j0 = moe_rank * inter
        gate_up, down = [], []
        for e in range(ep_rank * local, (ep_rank + 1) * local):
            g, u, dn = (self.need(n) for n in self.expert_names(p, e))
            gate_up.append(torch.cat([g[j0 : j0 + inter], u[j0 : j0 + inter]], dim=0))
            down.append(dn[:, j0 : j0 + inter])
        yield f"{p}.moe.router", self.need(self.router_name(p))
        yield f"{p}.moe.gate_up", torch.stack(gate_up)  # [E_local, 2*I_local, hidden]
        yield f"{p}.moe.down", torch.stack(down)  # [E_local, hidden, I_local]

    def shared_experts(self, source: str, target: str, intermediate: int) -> Named:
        """A shared expert (a gated MLP every token runs) from `source` as `target`, its
        intermediate dimension split over all tp ranks like the dense MLP's."""
        inter = intermediate // self.par.tp
        i0 = self.rank * inter
        for proj in ("gate_proj", "up_proj"):
            yield f"{target}.{proj}.weight", self.need(f"{source}.{proj}.weight")[i0 : i0 + inter]
        yield (
            f"{target}.down_proj.weight",
            self.need(f"{source}.down_proj.weight")[:, i0 : i0 + inter],
        )

    def expert_names(self, p: str, expert: int) -> tuple[str, str, str]:
        """HF names of (gate, up, down) for one expert."""
        e = f"{p}.mlp.experts.{expert}"
        return f"{e}.gate_proj.weight", f"{e}.up_proj.weight", f"{e}.down_proj.weight"

    def router_name(self, p: str) -> str:
        return f"{p}.mlp.gate.weight"


class MixtralShards(MoeShards):
    """Mixtral's names: `block_sparse_moe.experts.{e}.w1/w3/w2`, the router
    `block_sparse_moe.gate`."""

    def expert_names(self, p: str, expert: int) -> tuple[str, str, str]:
        e = f"{p}.block_sparse_moe.experts.{expert}"
        return f"{e}.w1.weight", f"{e}.w3.weight", f"{e}.w2.weight"

    def router_name(self, p: str) -> str:
        return f"{p}.block_sparse_moe.gate.weight"
