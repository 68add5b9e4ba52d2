"""Tensor and expert parallel sharding of a checkpoint, done once at build time.

Megatron-style: q/k/v and gate/up are column-parallel (each rank keeps its heads / its slice of the
intermediate dimension), o and down are row-parallel (each rank keeps the matching input columns;
the graph all-reduces their partial outputs). KV heads are split across ranks, or replicated when
tp > num_key_value_heads (rank r keeps KV head r // (tp / kv_heads), the one its query heads use),
so MQA/GQA models run at any tp that divides the query heads. The embedding and LM head are
vocab-parallel (Megatron's VocabParallelEmbedding, as NxDI and vLLM): rank r keeps rows
[r*R, (r+1)*R) with R = ceil(vocab / tp), the last shard zero-padded, so per-rank weight bytes fall
as 1/tp (a 128k vocabulary is 525 MB in bf16); the graph looks up with a mask and all-reduces,
and gathers the logits before sampling (llama.py). Norms are replicated. Row-parallel biases are
added once, after the all-reduce, so they stay whole.

MoE: the router is replicated; experts are split over `ep` groups of tp/ep ranks, and each expert's
intermediate dimension over the tp/ep ranks of its group. Each rank's experts are stacked into
`moe.gate_up` [E_local, 2*I_local, hidden] and `moe.down` [E_local, hidden, I_local].

`rank_weights` works on any tensors, so shapes come from meta tensors built from safetensors headers
and the very same code cuts the real weights: the graphs and the shards cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from neffkit.errors import ModelError
from neffkit.models.config import ModelConfig
from neffkit.models.parallel import Parallelism
from neffkit.models.rope_scaling import rope_frequencies

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
ROPE_INV_FREQ = "rope.inv_freq"  # a graph input like the weights; float32 in every bundle dtype
FP8_SCALE = ".scale"  # `<weight>.scale`: the float32 block scales beside an fp8 weight input
FLOAT32_TENSORS = frozenset({ROPE_INV_FREQ})
# DeepSeek's e_score_correction_bias; the fp8 KV cache's per-layer scales
FLOAT32_SUFFIXES = (".moe.router_score_bias", ".self_attn.k_scale", ".self_attn.v_scale")


def keeps_float32(name: str) -> bool:
    """Tensors the graphs read in float32 whatever the bundle dtype (as HF keeps them)."""
    return name in FLOAT32_TENSORS or name.endswith(FLOAT32_SUFFIXES)


def _expert_names(cfg: ModelConfig, prefix: str, expert: int) -> tuple[str, str, str]:
    """HF names of (gate, up, down) for one expert."""
    if cfg.architecture == "MixtralForCausalLM":
        e = f"{prefix}.block_sparse_moe.experts.{expert}"
        return f"{e}.w1.weight", f"{e}.w3.weight", f"{e}.w2.weight"
    e = f"{prefix}.mlp.experts.{expert}"
    return f"{e}.gate_proj.weight", f"{e}.up_proj.weight", f"{e}.down_proj.weight"


def _router_name(cfg: ModelConfig, prefix: str) -> str:
    if cfg.architecture == "MixtralForCausalLM":
        return f"{prefix}.block_sparse_moe.gate.weight"
    return f"{prefix}.mlp.gate.weight"


def rank_weights(
    cfg: ModelConfig,
    par: Parallelism,
    rank: int,
    get: Callable[[str], torch.Tensor],
    available: set[str],
    kv_scales: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for one rank, in graph order. Missing tensors are a ModelError.

    `kv_scales`: each layer's k_scale / v_scale (one float each, the fp8 KV cache's
    dequantization scales) follow its attention weights, replicated."""

    def need(name: str) -> torch.Tensor:
        if name not in available:
            raise ModelError(f"checkpoint is missing tensor {name!r}")
        return get(name)

    d = cfg.head_dim
    heads = cfg.num_heads // par.tp
    q0 = rank * heads * d
    kvh = par.kv_heads_per_rank(cfg)
    k0 = par.kv_head_start(cfg, rank) * d
    inter = cfg.intermediate_size // par.tp
    i0 = rank * inter
    yield (
        "model.embed_tokens.weight",
        _vocab_shard(need("model.embed_tokens.weight"), cfg, par, rank),
    )
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}"
        yield f"{p}.input_layernorm.weight", need(f"{p}.input_layernorm.weight")
        if cfg.is_mla:
            yield from _mla_shard(cfg, par, rank, f"{p}.self_attn", need, available)
        spans = (
            {}
            if cfg.is_mla
            else {"q_proj": (q0, heads * d), "k_proj": (k0, kvh * d), "v_proj": (k0, kvh * d)}
        )
        for proj in () if cfg.is_mla else _ATTN:
            w = need(f"{p}.self_attn.{proj}.weight")
            bias = f"{p}.self_attn.{proj}.bias"
            if proj == "o_proj":
                yield f"{p}.self_attn.o_proj.weight", w[:, q0 : q0 + heads * d]
                if bias in available:
                    yield bias, get(bias)  # added once, after the all-reduce
                continue
            start, size = spans[proj]
            yield f"{p}.self_attn.{proj}.weight", w[start : start + size]
            if bias in available:
                yield bias, get(bias)[start : start + size]
        if kv_scales:
            for kind in ("k", "v"):
                yield (
                    f"{p}.self_attn.{kind}_scale",
                    need(kv_scale_name(p, kind, available)).reshape(1),
                )
        if cfg.attention_sinks:  # one logit per query head: this rank's heads
            yield f"{p}.self_attn.sinks", need(f"{p}.self_attn.sinks")[q0 // d : q0 // d + heads]
        if cfg.qk_norm:
            yield f"{p}.self_attn.q_norm.weight", need(f"{p}.self_attn.q_norm.weight")
            yield f"{p}.self_attn.k_norm.weight", need(f"{p}.self_attn.k_norm.weight")
        yield f"{p}.post_attention_layernorm.weight", need(f"{p}.post_attention_layernorm.weight")
        if cfg.is_moe and cfg.sparse_layers[layer]:
            shard = _gpt_oss_moe_shard if cfg.moe_bias else _moe_shard
            yield from shard(cfg, par, rank, p, need)
            if cfg.router_sigmoid:  # DeepSeek: selection bias, shared experts (tp-split)
                yield f"{p}.moe.router_score_bias", need(f"{p}.mlp.gate.e_score_correction_bias")
            if cfg.shared_intermediate_size:
                inter_s = cfg.shared_intermediate_size // par.tp
                source = f"{p}.mlp.shared_experts"
                yield from _mlp_shard(inter_s, rank, source, f"{p}.moe.shared", need)
            continue
        for proj in ("gate_proj", "up_proj", "down_proj"):
            w = need(f"{p}.mlp.{proj}.weight")
            bias = f"{p}.mlp.{proj}.bias"
            if proj == "down_proj":
                yield f"{p}.mlp.down_proj.weight", w[:, i0 : i0 + inter]
                if bias in available:
                    yield bias, get(bias)
            else:
                yield f"{p}.mlp.{proj}.weight", w[i0 : i0 + inter]
                if bias in available:
                    yield bias, get(bias)[i0 : i0 + inter]
    yield "model.norm.weight", need("model.norm.weight")
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", _vocab_shard(need("lm_head.weight"), cfg, par, rank)
    # computed, not read: the rope frequencies as HF derives them (float32, never cast)
    yield ROPE_INV_FREQ, rope_frequencies(cfg.rope_params, cfg.head_dim)[0]


def kv_scale_name(prefix: str, kind: str, available: set[str]) -> str:
    """A layer's K or V cache scale as the checkpoint names it (compressed-tensors puts it on
    the attention module, ModelOpt exports on the projection)."""
    on_projection = f"{prefix}.self_attn.{kind}_proj.{kind}_scale"
    return on_projection if on_projection in available else f"{prefix}.self_attn.{kind}_scale"


def _vocab_shard(
    table: torch.Tensor, cfg: ModelConfig, par: Parallelism, rank: int
) -> torch.Tensor:
    """This rank's rows of a [vocab, hidden] table; the last shard zero-padded to full size."""
    if par.tp == 1:
        return table
    if table.shape[0] != cfg.vocab_size:
        raise ModelError(
            f"embedding/LM head has {table.shape[0]} rows; config.json says vocab_size "
            f"{cfg.vocab_size}"
        )
    rows = par.vocab_rows(cfg)
    part = table[rank * rows : min((rank + 1) * rows, cfg.vocab_size)]
    if part.shape[0] < rows:
        part = torch.cat((part, part.new_zeros((rows - part.shape[0], *table.shape[1:]))))
    return part


def _moe_shard(cfg, par, rank, prefix, need):
    local = cfg.num_experts // par.ep
    ep_rank, moe_rank = rank // par.moe_tp, rank % par.moe_tp
    inter = cfg.moe_intermediate_size // par.moe_tp
    j0 = moe_rank * inter
    gate_up, down = [], []
    for e in range(ep_rank * local, (ep_rank + 1) * local):
        g, u, dn = (need(n) for n in _expert_names(cfg, prefix, e))
        gate_up.append(torch.cat([g[j0 : j0 + inter], u[j0 : j0 + inter]], dim=0))
        down.append(dn[:, j0 : j0 + inter])
    yield f"{prefix}.moe.router", need(_router_name(cfg, prefix))
    yield f"{prefix}.moe.gate_up", torch.stack(gate_up)  # [E_local, 2*I_local, hidden]
    yield f"{prefix}.moe.down", torch.stack(down)  # [E_local, hidden, I_local]


def _gpt_oss_moe_shard(cfg, par, rank, prefix, need):
    """GPT-OSS's experts into the stacked layout: `gate_up_proj` [E, hidden, 2I] holds gate and
    up interleaved (even, odd columns), `down_proj` is [E, I, hidden]; both have biases. The down
    bias is added once per expert group: ranks other than the group's first hold zeros."""
    local = cfg.num_experts // par.ep
    ep_rank, moe_rank = rank // par.moe_tp, rank % par.moe_tp
    inter = cfg.moe_intermediate_size // par.moe_tp
    j0, e0 = moe_rank * inter, ep_rank * local
    ex = f"{prefix}.mlp.experts"
    gu = need(f"{ex}.gate_up_proj")[e0 : e0 + local]  # [E_local, hidden, 2I]
    gate, up = gu[..., 0::2][..., j0 : j0 + inter], gu[..., 1::2][..., j0 : j0 + inter]
    bias = need(f"{ex}.gate_up_proj_bias")[e0 : e0 + local]  # [E_local, 2I]
    gate_b, up_b = bias[..., 0::2][..., j0 : j0 + inter], bias[..., 1::2][..., j0 : j0 + inter]
    down = need(f"{ex}.down_proj")[e0 : e0 + local, j0 : j0 + inter]  # [E_local, I_local, hidden]
    down_b = need(f"{ex}.down_proj_bias")[e0 : e0 + local]
    yield f"{prefix}.moe.router", need(f"{prefix}.mlp.router.weight")
    yield f"{prefix}.moe.router_bias", need(f"{prefix}.mlp.router.bias")
    yield f"{prefix}.moe.gate_up", torch.cat([gate, up], dim=-1).transpose(1, 2)
    yield f"{prefix}.moe.gate_up_bias", torch.cat([gate_b, up_b], dim=-1)  # [E_local, 2I_local]
    yield f"{prefix}.moe.down", down.transpose(1, 2)  # [E_local, hidden, I_local]
    yield f"{prefix}.moe.down_bias", down_b if moe_rank == 0 else torch.zeros_like(down_b)


def _mlp_shard(inter: int, rank: int, source: str, target: str, need):
    """A bias-free SwiGLU MLP cut Megatron-style: gate/up rows, down columns."""
    i0 = rank * inter
    yield f"{target}.gate_proj.weight", need(f"{source}.gate_proj.weight")[i0 : i0 + inter]
    yield f"{target}.up_proj.weight", need(f"{source}.up_proj.weight")[i0 : i0 + inter]
    yield f"{target}.down_proj.weight", need(f"{source}.down_proj.weight")[:, i0 : i0 + inter]


def _mla_shard(cfg, par, rank, a, need, available):
    """DeepSeek-V3's latent attention: the latent projections (kv_a_proj_with_mqa,
    kv_a_layernorm; q_a_proj, q_a_layernorm) are replicated, so every rank keeps the whole
    latent cache (as vLLM does); the per-head up-projections (q_b_proj or q_proj, kv_b_proj)
    keep this rank's heads, and o_proj the matching input columns (row-parallel)."""
    heads = cfg.num_heads // par.tp
    h0 = rank * heads
    qk = cfg.qk_nope_head_dim + cfg.head_dim
    kvb = cfg.qk_nope_head_dim + cfg.v_head_dim

    def whole(name):
        yield f"{a}.{name}.weight", need(f"{a}.{name}.weight")
        if f"{a}.{name}.bias" in available:
            yield f"{a}.{name}.bias", need(f"{a}.{name}.bias")

    if cfg.q_lora_rank:
        yield from whole("q_a_proj")
        yield f"{a}.q_a_layernorm.weight", need(f"{a}.q_a_layernorm.weight")
        yield f"{a}.q_b_proj.weight", need(f"{a}.q_b_proj.weight")[h0 * qk : (h0 + heads) * qk]
    else:
        yield f"{a}.q_proj.weight", need(f"{a}.q_proj.weight")[h0 * qk : (h0 + heads) * qk]
    yield from whole("kv_a_proj_with_mqa")
    yield f"{a}.kv_a_layernorm.weight", need(f"{a}.kv_a_layernorm.weight")
    yield f"{a}.kv_b_proj.weight", need(f"{a}.kv_b_proj.weight")[h0 * kvb : (h0 + heads) * kvb]
    v = cfg.v_head_dim
    yield f"{a}.o_proj.weight", need(f"{a}.o_proj.weight")[:, h0 * v : (h0 + heads) * v]
    if f"{a}.o_proj.bias" in available:
        yield f"{a}.o_proj.bias", need(f"{a}.o_proj.bias")  # added once, after the all-reduce
