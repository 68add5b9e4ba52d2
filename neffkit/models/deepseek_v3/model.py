"""DeepSeek-V3's graph and sharding rules over the MoE family's: multi-head latent attention over
a latent cache, sigmoid group-limited routing, and shared experts beside the routed ones."""

from __future__ import annotations

from collections.abc import Callable

import torch

from neffkit.contract import abi
from neffkit.contract.abi import GraphShape
from neffkit.kernels.attention import paged_attention
from neffkit.kernels.kv import gather_context, write_cache
from neffkit.kernels.rope import apply_rope, apply_rope_interleaved
from neffkit.models.deepseek_v3.config import DeepseekV3Config, DeepseekV3MtpConfig
from neffkit.models.experts import Routing
from neffkit.models.forms import PLAIN, ProjectionPolicy
from neffkit.models.moe.model import MoeGraph, MoeShards, W
from neffkit.models.parallel import Parallelism
from neffkit.models.rope_scaling import yarn_mscale
from neffkit.models.shards import Named
from neffkit.models.step import Step
from neffkit.targets import E4M3FN_MAX


class DeepseekV3Graph(MoeGraph):
    cfg: DeepseekV3Config

    def __init__(
        self,
        cfg: DeepseekV3Config,
        shape: GraphShape,
        weight_names: list[str],
        max_top_k: int,
        par: Parallelism | None = None,
        projection: ProjectionPolicy = PLAIN,
        fp8_max: float = E4M3FN_MAX,
        *,
        mla_decode: str = "absorbed",
    ) -> None:
        super().__init__(cfg, shape, weight_names, max_top_k, par, projection, fp8_max)
        # MLA decode graphs: latent-space attention ("absorbed"), or per-head K/V expanded from
        # the latent context every step ("expanded", HF's form; for comparison)
        self.mla_decode = mla_decode

    def attention(self, x: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        """Multi-head latent attention over the latent cache.

        Each token caches its normalised latent (kv_lora_rank) and its rotated rope key
        (qk_rope_head_dim): one row shared by every head. Prefill expands the context into
        per-head keys and values through kv_b_proj (HF's form). Decode attends in the latent
        space: kv_b_proj's key half is absorbed into the query and its value half applied to
        the attended latent, so a step reads the latent cache, not per-head K/V.
        """
        cfg, w, a = self.cfg, step.w, f"model.layers.{layer}.self_attn"
        cache, mask = step.caches[layer], step.masks[self.span(layer)]
        rows, tokens, _ = x.shape
        nope, rope, vdim, latent = (
            cfg.qk_nope_head_dim,
            cfg.head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        )
        if cfg.q_lora_rank:
            q_low = self.norm(self.linear(x, w, f"{a}.q_a_proj"), w[f"{a}.q_a_layernorm.weight"])
            q = self.linear(q_low, w, f"{a}.q_b_proj")
        else:
            q = self.linear(x, w, f"{a}.q_proj")
        heads = q.shape[-1] // (nope + rope)
        q = q.view(rows, tokens, heads, nope + rope)
        compressed = self.linear(x, w, f"{a}.kv_a_proj_with_mqa")  # [B, T, latent + rope]
        c = self.norm(compressed[..., :latent], w[f"{a}.kv_a_layernorm.weight"])
        rotate = apply_rope_interleaved if cfg.rope_interleave else apply_rope
        q_rope = rotate(q[..., nope:], step.cos, step.sin)
        k_rope = rotate(compressed[..., latent:].unsqueeze(2), step.cos, step.sin)  # [B,T,1,rope]
        entry = torch.cat((c.unsqueeze(2), k_rope), dim=-1)  # [B, T, 1, latent + rope]
        write_cache(cache, entry.reshape(-1, 1, latent + rope), step.slots)
        context = gather_context(cache, step.block_tables)  # [B, C, 1, latent + rope]
        up = w[f"{a}.kv_b_proj.weight"].view(heads, nope + vdim, latent)
        up_k, up_v = up[:, :nope], up[:, nope:]  # [H, nope, latent], [H, v, latent]
        scale = mla_softmax_scale(cfg)
        if self.shape.rule.one_token and self.mla_decode == "absorbed":  # MQA over the latent
            q_latent = torch.einsum("bthn,hnl->bthl", q[..., :nope], up_k)
            query = torch.cat((q_latent, q_rope), dim=-1)  # [B, T, H, latent + rope]
            out = paged_attention(query, context, context[..., :latent], mask, scale)
            out = torch.einsum("bthl,hvl->bthv", out.view(rows, tokens, heads, latent), up_v)
        else:  # expanded: per-head keys and values from the latent context
            c_ctx = context[:, :, 0, :latent]  # [B, C, latent]
            k_nope = torch.einsum("bcl,hnl->bchn", c_ctx, up_k)
            values = torch.einsum("bcl,hvl->bchv", c_ctx, up_v)
            k_ctx = context[..., latent:].expand(-1, -1, heads, -1)  # [B, C, H, rope]
            keys = torch.cat((k_nope, k_ctx), dim=-1)
            query = torch.cat((q[..., :nope], q_rope), dim=-1)
            out = paged_attention(query, keys, values, mask, scale)
        out = out.reshape(rows, tokens, heads * vdim)
        partial = self.project(out, w[f"{a}.o_proj.weight"])  # row-parallel: partial sum
        return self.reduce(partial, w.get(f"{a}.o_proj.bias"))

    def route(self, x2: torch.Tensor, w: W, p: str) -> Routing:
        """Sigmoid scores (float32); the selection adds e_score_correction_bias, keeps the
        `topk_group` groups whose two best scores sum highest, and takes the top k there; the
        weights are the unbiased scores, renormalised, times routed_scaling_factor."""
        cfg = self.cfg
        experts, groups = cfg.num_experts, cfg.router_groups
        scores = torch.sigmoid(x2.float() @ w[f"{p}.moe.router"].float().t())  # [N, E]
        choice = scores + w[f"{p}.moe.router_score_bias"].float()
        n = choice.shape[0]
        group_scores = choice.view(n, groups, experts // groups).topk(2, dim=-1)[0].sum(-1)
        best = torch.topk(group_scores, cfg.router_topk_groups, dim=-1)[1]  # [N, topk_group]
        keep = torch.zeros_like(group_scores).scatter(1, best, 1.0)  # [N, G]
        keep = keep.unsqueeze(-1).expand(n, groups, experts // groups).reshape(n, experts)
        choice = torch.where(keep > 0, choice, float("-inf"))
        top_i = torch.topk(choice, cfg.experts_per_token, dim=-1)[1]
        top_w = scores.gather(1, top_i)
        if cfg.norm_topk_prob:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(top_i, top_w * cfg.routed_scaling_factor)

    def shared(self, routed: torch.Tensor, x: torch.Tensor, w: W, p: str) -> torch.Tensor:
        """The shared experts run on every token next to the routed ones."""
        if not self.cfg.shared_intermediate_size:
            return routed
        return routed + self.mlp(x, w, f"{p}.moe.shared")


def mla_softmax_scale(cfg: DeepseekV3Config) -> float:
    """HF's DeepSeek-V3 scaling: 1/sqrt(qk head dim), times yarn's mscale(mscale_all_dim)^2."""
    scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
    params = cfg.rope_params
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params["rope_type"] != "default" and mscale_all_dim:
        mscale = yarn_mscale(params["factor"], mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


class DeepseekV3Shards(MoeShards):
    cfg: DeepseekV3Config

    def attention(self, p: str) -> Named:
        """The latent projections (kv_a_proj_with_mqa, kv_a_layernorm; q_a_proj, q_a_layernorm)
        are replicated, so every rank keeps the whole latent cache (as vLLM does); the per-head
        up-projections (q_b_proj or q_proj, kv_b_proj) keep this rank's heads, and o_proj the
        matching input columns (row-parallel)."""
        cfg, a = self.cfg, f"{p}.self_attn"
        heads = self.heads
        h0 = self.rank * heads
        qk = cfg.qk_nope_head_dim + cfg.head_dim
        kvb = cfg.qk_nope_head_dim + cfg.v_head_dim
        if cfg.q_lora_rank:
            yield from self.whole(f"{a}.q_a_proj")
            yield f"{a}.q_a_layernorm.weight", self.need(f"{a}.q_a_layernorm.weight")
            yield (
                f"{a}.q_b_proj.weight",
                self.need(f"{a}.q_b_proj.weight")[h0 * qk : (h0 + heads) * qk],
            )
        else:
            yield f"{a}.q_proj.weight", self.need(f"{a}.q_proj.weight")[h0 * qk : (h0 + heads) * qk]
        yield from self.whole(f"{a}.kv_a_proj_with_mqa")
        yield f"{a}.kv_a_layernorm.weight", self.need(f"{a}.kv_a_layernorm.weight")
        yield (
            f"{a}.kv_b_proj.weight",
            self.need(f"{a}.kv_b_proj.weight")[h0 * kvb : (h0 + heads) * kvb],
        )
        v = cfg.v_head_dim
        yield from self.row(f"{a}.o_proj", h0 * v, heads * v)

    def whole(self, prefix: str) -> Named:
        """A replicated projection and its bias."""
        yield f"{prefix}.weight", self.need(f"{prefix}.weight")
        if f"{prefix}.bias" in self.available:
            yield f"{prefix}.bias", self.need(f"{prefix}.bias")

    def experts(self, p: str) -> Named:
        """The routed experts, the routing's selection bias, the shared experts (tp-split)."""
        yield from super().experts(p)
        yield f"{p}.moe.router_score_bias", self.need(f"{p}.mlp.gate.e_score_correction_bias")
        if self.cfg.shared_intermediate_size:
            yield from self.shared_experts(
                f"{p}.mlp.shared_experts", f"{p}.moe.shared", self.cfg.shared_intermediate_size
            )


# ---------------------------------------------------------------- the MTP layer (speculation)
MTP_WEIGHTS = ("mtp.enorm.weight", "mtp.hnorm.weight", "mtp.eh_proj.weight")


class DeepseekV3MtpGraph(DeepseekV3Graph):
    """DeepSeek-V3's multi-token prediction layer as a one-layer graph (vLLM's deepseek_mtp.py):
    position p reads token p + 1's embedding (zero at position 0) and the hidden state token
    p + 1 was predicted from (`previous_hidden`), normalises each (enorm, hnorm), projects their
    concatenation (eh_proj) and runs one decoder layer over its own latent cache; its norm and
    head (shared_head) give the token after, and its output hidden state is returned for the
    next step."""

    cfg: DeepseekV3MtpConfig

    def prelude(
        self, h: torch.Tensor, m: dict[str, torch.Tensor], w: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        first = (m[abi.POSITIONS] == 0).unsqueeze(-1)  # [B, T, 1]
        h = torch.where(first, torch.zeros_like(h), h)
        previous = m[abi.PREVIOUS_HIDDEN].to(h.dtype)  # [B, T, hidden]
        mixed = torch.cat(
            (self.norm(h, w["mtp.enorm.weight"]), self.norm(previous, w["mtp.hnorm.weight"])),
            dim=-1,
        )  # [B, T, 2 * hidden]
        return self.project(mixed, w["mtp.eh_proj.weight"])


class DeepseekV3MtpShards(DeepseekV3Shards):
    """The MTP layer's tensors under the one-layer model's names: the checkpoint's
    `model.layers.{N}.*` block as layer 0, its shared_head as the final norm and LM head, its
    embed_tokens (the main one where absent), then enorm, hnorm and eh_proj."""

    cfg: DeepseekV3MtpConfig

    def __init__(
        self,
        cfg: DeepseekV3MtpConfig,
        par: Parallelism,
        rank: int,
        get: Callable[[str], torch.Tensor],
        available: set[str],
        kv_scales: bool = False,
    ) -> None:
        src = f"model.layers.{cfg.source_layer}"
        special = {
            "model.norm.weight": f"{src}.shared_head.norm.weight",
            "lm_head.weight": f"{src}.shared_head.head.weight",
            **{name: f"{src}.{name.split('.', 1)[1]}" for name in MTP_WEIGHTS},
        }
        if f"{src}.embed_tokens.weight" in available:
            special["model.embed_tokens.weight"] = f"{src}.embed_tokens.weight"

        def source(name: str) -> str:
            if name in special:
                return special[name]
            if name.startswith("model.layers.0."):
                return src + name.removeprefix("model.layers.0")
            return name

        names = {*special, "model.embed_tokens.weight"}
        names |= {"model.layers.0" + n.removeprefix(src) for n in available if n.startswith(src)}
        mine = {n for n in names if source(n) in available}
        super().__init__(cfg, par, rank, lambda name: get(source(name)), mine, kv_scales)

    def __iter__(self) -> Named:
        yield from super().__iter__()
        for name in MTP_WEIGHTS:
            yield name, self.need(name)
