"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as one static-shape paged forward per graph.

A graph is a full forward: embedding, all layers, final norm, LM head, sampling, KV writes. Inputs
are flat and ordered as `graph_inputs` lists them: metadata, then one K and one V tensor per layer,
then the weights. Weights as inputs let one copy in memory serve every graph, and are what
neuronx-cc and torch-mlir expect. Nothing here reads a tensor value on the host: shapes are static
per graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from neffkit.kernels.attention import context_mask, packed_context_mask, paged_attention
from neffkit.kernels.kv import from_cache, gather_context, to_cache, write_cache, write_kv
from neffkit.kernels.norm import rms_norm
from neffkit.kernels.quant import dequantize_blocks
from neffkit.kernels.rope import apply_rope, apply_rope_interleaved, rope_cos_sin
from neffkit.kernels.sampling import sample, target_logprobs
from neffkit.models.config import ModelConfig
from neffkit.models.moe import Routing, dense_weights, gather_rows, local_slots
from neffkit.models.parallel import Parallelism
from neffkit.models.projection import (
    PLAIN,
    ProjectionPolicy,
    materialized,
    out_features,
    project,
)
from neffkit.models.rope_scaling import rope_frequencies, yarn_mscale
from neffkit.models.sharding import FP8_SCALE as SCALE
from neffkit.models.sharding import ROPE_INV_FREQ
from neffkit.targets import E4M3FN_MAX

SAMPLING_INPUTS = (
    ("temperature", "float32"),
    ("top_k", "int64"),
    ("top_p", "float32"),
    ("seed", "int64"),
)


@dataclass(frozen=True)
class GraphShape:
    """Static shape of one graph: B rows of T tokens attending to at most C context tokens."""

    # "prefill": T tokens of `rows` sequences packed in one row (rows > 1: per-token sequence
    # ids; each sequence has its own block table, length, last token and sampling values), or
    # "decode": `rows` sequences, one token each
    phase: str
    rows: int
    tokens: int
    context: int
    block_size: int
    num_blocks: int
    logprobs: int = 5  # top logprobs per sampled token (the manifest's sampling.max_logprobs)
    prompt_logprobs: bool = False  # prefill also returns each prompt token's logprobs
    # decode reads each row's token from the `last_tokens` state (manifest decode_state: device)
    device_state: bool = False

    @property
    def packed(self) -> bool:
        """A prefill of several sequences' tokens in one row."""
        return self.phase == "prefill" and self.rows > 1


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str


def metadata_inputs(shape: GraphShape) -> list[TensorSpec]:
    """The host-built inputs, in order. With device state a decode graph takes no input_ids:
    `seq_slots` (each row's sequence's slot in `last_tokens`; 0 pads) says where its token is,
    and prefill takes `seq_slots` too, to store each sequence's sampled token there."""
    b, t = shape.rows, shape.tokens
    lines = 1 if shape.phase == "prefill" else b  # prefill: every sequence's tokens in one row
    host_ids = shape.phase == "prefill" or not shape.device_state
    specs = [TensorSpec("input_ids", (lines, t), "int64")] if host_ids else []
    specs += [
        TensorSpec("positions", (lines, t), "int64"),
        TensorSpec("slot_mapping", (lines, t), "int64"),
        TensorSpec("block_tables", (b, shape.context // shape.block_size), "int64"),
        TensorSpec("context_lens", (b,), "int64"),
    ]
    if shape.packed:
        specs.append(TensorSpec("seq_ids", (1, t), "int64"))  # each token's sequence
    if shape.phase == "prefill":
        specs.append(TensorSpec("last_token_index", (b,), "int64"))  # in the packed row
    if shape.device_state:
        specs.append(TensorSpec("seq_slots", (b,), "int64"))
    specs += [TensorSpec(name, (b,), dtype) for name, dtype in SAMPLING_INPUTS]
    if shape.phase == "prefill" and shape.prompt_logprobs:
        specs.append(TensorSpec("target_ids", (b, t), "int64"))  # the token after each position
    return specs


def graph_outputs(shape: GraphShape) -> list[TensorSpec]:
    """The user outputs, in order (the K/V mutations precede them in an exported program)."""
    b, n = shape.rows, shape.logprobs
    specs = [
        TensorSpec("next_tokens", (b,), "int64"),
        TensorSpec("token_logprobs", (b,), "float32"),
        TensorSpec("top_logprob_ids", (b, n), "int64"),
        TensorSpec("top_logprobs", (b, n), "float32"),
    ]
    if shape.phase == "prefill" and shape.prompt_logprobs:
        t = shape.tokens
        specs += [
            TensorSpec("prompt_logprobs", (t,), "float32"),
            TensorSpec("prompt_top_logprob_ids", (t, n), "int64"),
            TensorSpec("prompt_top_logprobs", (t, n), "float32"),
        ]
    return specs


def kv_inputs(cfg: ModelConfig, shape: GraphShape, kv_heads: int, dtype: str) -> list[TensorSpec]:
    """One K and one V tensor per layer; MLA: one latent tensor per layer (`kv_cache.i`,
    [blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim], shared by all heads)."""
    kv_shape = (shape.num_blocks, shape.block_size, kv_heads, cfg.kv_width)
    kinds = ("kv",) if cfg.is_mla else ("k", "v")
    return [
        TensorSpec(f"{kind}_cache.{layer}", kv_shape, dtype)
        for layer in range(cfg.num_layers)
        for kind in kinds
    ]


def state_inputs(shape: GraphShape) -> list[TensorSpec]:
    """Device-resident decode state (decode_state: device): `last_tokens[slot]`, the last token
    sampled for the sequence in that slot, aliased like the K/V caches. A sequence's slot is its
    first KV block (unique among live sequences; block 0, the null block, is the padding slot)."""
    return [TensorSpec("last_tokens", (shape.num_blocks,), "int64")] if shape.device_state else []


class DecoderGraph(torch.nn.Module):
    """forward(*flat_inputs) → the tensors `graph_outputs` lists (next tokens and logprobs);
    K/V caches are mutated in place (io-aliased)."""

    def __init__(
        self,
        cfg: ModelConfig,
        shape: GraphShape,
        weight_names: list[str],
        num_meta: int,
        max_top_k: int,
        par: Parallelism | None = None,
        projection: ProjectionPolicy = PLAIN,
        mla_decode: str = "absorbed",
        fp8_max: float = E4M3FN_MAX,
    ) -> None:
        super().__init__()
        self.fp8_max = fp8_max  # the range fp8 cache values are clamped to (targets.fp8_max)
        self.cfg = cfg
        self.shape = shape
        self.weight_names = weight_names
        self.meta_names = [spec.name for spec in metadata_inputs(shape)]
        self.num_meta = num_meta
        assert num_meta == len(self.meta_names)
        self.max_top_k = max_top_k
        self.par = par or Parallelism()
        self.has_rank = self.par.needs_rank_input(cfg)
        self.projection = projection
        self.mla_decode = mla_decode
        self.rope_attention_factor = rope_frequencies(cfg.rope_params, cfg.head_dim)[1]

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg, shape = self.cfg, self.shape
        m = dict(zip(self.meta_names, flat[: self.num_meta], strict=True))
        rest = flat[self.num_meta :]
        self.rank = rest[0] if self.has_rank else None  # [1] int64: this graph's rank, as data
        rest = rest[1:] if self.has_rank else rest
        per_layer = 1 if cfg.is_mla else 2  # MLA: one latent cache tensor per layer
        kv = rest[: per_layer * cfg.num_layers]
        rest = rest[per_layer * cfg.num_layers :]
        last_tokens = rest[0] if shape.device_state else None  # [num_blocks] int64, aliased
        rest = rest[1:] if shape.device_state else rest
        w = dict(zip(self.weight_names, rest, strict=True))
        if cfg.fp8_block:  # block fp8 weights: widened right before use (kernels/quant.py)
            w = self._dequantized(w)
        positions, slot_mapping = m["positions"], m["slot_mapping"]
        block_tables, context_lens = m["block_tables"], m["context_lens"]
        seq_ids = m.get("seq_ids")
        temperature, top_k, top_p, seed = (m[name] for name, _ in SAMPLING_INPUTS)
        rows, tokens = positions.shape
        state_slots = None
        if last_tokens is not None:  # clamped like every index from the host (audit NK303)
            state_slots = m["seq_slots"].clamp(0, last_tokens.shape[0] - 1)
        if "input_ids" in m:
            input_ids = m["input_ids"]
        else:  # device state: each row's token is the one the last step stored for its sequence
            assert last_tokens is not None and state_slots is not None
            input_ids = last_tokens.index_select(0, state_slots).unsqueeze(1)  # [B, 1]

        # Ids are validated on the host; the clamp is defence in depth: an out-of-range gather is
        # an out-of-bounds DMA on Neuron and a crash on CPU (audit rule NK109).
        ids = input_ids.clamp(0, cfg.vocab_size - 1)
        h = self._embed(ids, w["model.embed_tokens.weight"])  # [B, T, hidden]
        cos, sin = rope_cos_sin(
            positions, w[ROPE_INV_FREQ], self.rope_attention_factor, h.dtype
        )  # [B, T, 1, D]
        if seq_ids is not None:  # packed: one row attending to every sequence's context
            masks = {
                window: packed_context_mask(positions, seq_ids, context_lens, shape.context, window)
                for window in set(cfg.sliding_windows)
            }  # [1, T, S*C] per distinct window
            block_tables = block_tables.reshape(1, -1)  # [1, S*C/bs]: the contexts side by side
        else:
            masks = {
                window: context_mask(positions, context_lens, shape.context, window)
                for window in set(cfg.sliding_windows)
            }  # [B, T, C] per distinct window
        slots = slot_mapping.reshape(-1)  # [B*T]
        for layer in range(cfg.num_layers):
            p = f"model.layers.{layer}"
            x = self._norm(h, w[f"{p}.input_layernorm.weight"])
            mask = masks[cfg.sliding_windows[layer]]
            if cfg.is_mla:
                attn = self._mla(x, w, p, cos, sin, kv[layer], slots, block_tables, mask)
            else:
                attn = self._attention(
                    x, w, p, cos, sin, kv[2 * layer], kv[2 * layer + 1], slots, block_tables, mask
                )
            h = h + attn
            x = self._norm(h, w[f"{p}.post_attention_layernorm.weight"])
            if cfg.is_moe and cfg.sparse_layers[layer]:
                h = h + self._reduce(self._moe(x, w, p), None)
                continue
            h = h + self._reduce(self._mlp(x, w, f"{p}.mlp"), w.get(f"{p}.mlp.down_proj.bias"))

        head = w["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        prompt: tuple[torch.Tensor, ...] = ()
        if shape.phase == "prefill":
            # [S]: each sequence's last token in the row; clamped like every index from the
            # host (audit NK303: a gather past the chunk would be an out-of-bounds DMA on Neuron)
            last = m["last_token_index"].clamp(0, tokens - 1)
            last_pos = positions[0].index_select(0, last)  # [S]
            if shape.prompt_logprobs:  # the LM head on every position (TRT-LLM's context logits)
                h_all = self._norm(h[0], w["model.norm.weight"])
                all_logits = self._head(h_all, head)  # [T, vocab]
                targets = m["target_ids"][0].clamp(0, cfg.vocab_size - 1)  # [T]
                prompt = target_logprobs(all_logits, targets, shape.logprobs)
                logits = all_logits.index_select(0, last)  # [1, vocab]
            else:
                h_last = self._norm(h[0].index_select(0, last), w["model.norm.weight"])
                logits = self._head(h_last, head)  # [1, vocab]
        else:
            last_pos = positions[:, -1]  # [B]
            h_last = self._norm(h[:, -1], w["model.norm.weight"])
            logits = self._head(h_last, head)  # [B, vocab]
        sampled = sample(
            logits, temperature, top_k, top_p, seed, last_pos, self.max_top_k, shape.logprobs
        )
        if last_tokens is not None:  # the next decode step's input, stored on the device
            # padding rows all write the padding slot 0, which no sequence reads
            last_tokens.index_put_((state_slots,), sampled[0])
        return (*sampled, *prompt)

    def _attention(self, x, w, p, cos, sin, k_cache, v_cache, slots, block_tables, mask):
        cfg = self.cfg
        rows, tokens, _ = x.shape
        kv_heads = k_cache.shape[2]
        heads = out_features(w[f"{p}.self_attn.q_proj.weight"]) // cfg.head_dim
        q = self._linear(x, w, f"{p}.self_attn.q_proj").view(rows, tokens, heads, cfg.head_dim)
        k = self._linear(x, w, f"{p}.self_attn.k_proj").view(rows, tokens, kv_heads, cfg.head_dim)
        v = self._linear(x, w, f"{p}.self_attn.v_proj").view(rows, tokens, kv_heads, cfg.head_dim)
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm before RoPE
            q = self._norm(q, w[f"{p}.self_attn.q_norm.weight"])
            k = self._norm(k, w[f"{p}.self_attn.k_norm.weight"])
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_scale, v_scale = w.get(f"{p}.self_attn.k_scale"), w.get(f"{p}.self_attn.v_scale")
        fp8_max = self.fp8_max
        write_kv(
            k_cache,
            v_cache,
            to_cache(k.reshape(-1, kv_heads, cfg.head_dim), k_cache.dtype, fp8_max, k_scale),
            to_cache(v.reshape(-1, kv_heads, cfg.head_dim), v_cache.dtype, fp8_max, v_scale),
            slots,
        )
        keys = from_cache(gather_context(k_cache, block_tables), q.dtype, k_scale)  # [B,C,KV,D]
        values = from_cache(gather_context(v_cache, block_tables), q.dtype, v_scale)
        sinks = w.get(f"{p}.self_attn.sinks")  # GPT-OSS
        if self.projection.buffer_queries:
            q = materialized(q)
        out = paged_attention(q, keys, values, mask, 1.0 / math.sqrt(cfg.head_dim), sinks)
        partial = self._project(out, w[f"{p}.self_attn.o_proj.weight"])  # row-parallel: partial sum
        return self._reduce(partial, w.get(f"{p}.self_attn.o_proj.bias"))

    def _mla(self, x, w, p, cos, sin, cache, slots, block_tables, mask):
        """DeepSeek's multi-head latent attention over the latent cache.

        Each token caches its normalised latent (kv_lora_rank) and its rotated rope key
        (qk_rope_head_dim): one row shared by every head. Prefill expands the context into
        per-head keys and values through kv_b_proj (HF's form). Decode attends in the latent
        space: kv_b_proj's key half is absorbed into the query and its value half applied to
        the attended latent, so a step reads the latent cache, not per-head K/V.
        """
        cfg, a = self.cfg, f"{p}.self_attn"
        rows, tokens, _ = x.shape
        nope, rope, vdim, latent = (
            cfg.qk_nope_head_dim,
            cfg.head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        )
        if cfg.q_lora_rank:
            q_low = self._norm(self._linear(x, w, f"{a}.q_a_proj"), w[f"{a}.q_a_layernorm.weight"])
            q = self._linear(q_low, w, f"{a}.q_b_proj")
        else:
            q = self._linear(x, w, f"{a}.q_proj")
        heads = q.shape[-1] // (nope + rope)
        q = q.view(rows, tokens, heads, nope + rope)
        compressed = self._linear(x, w, f"{a}.kv_a_proj_with_mqa")  # [B, T, latent + rope]
        c = self._norm(compressed[..., :latent], w[f"{a}.kv_a_layernorm.weight"])
        rotate = apply_rope_interleaved if cfg.rope_interleave else apply_rope
        q_rope = rotate(q[..., nope:], cos, sin)
        k_rope = rotate(compressed[..., latent:].unsqueeze(2), cos, sin)  # [B, T, 1, rope]
        entry = torch.cat((c.unsqueeze(2), k_rope), dim=-1)  # [B, T, 1, latent + rope]
        write_cache(cache, entry.reshape(-1, 1, latent + rope), slots)
        context = gather_context(cache, block_tables)  # [B, C, 1, latent + rope]
        up = w[f"{a}.kv_b_proj.weight"].view(heads, nope + vdim, latent)
        up_k, up_v = up[:, :nope], up[:, nope:]  # [H, nope, latent], [H, v, latent]
        scale = mla_softmax_scale(cfg)
        if self.shape.phase == "decode" and self.mla_decode == "absorbed":  # MQA over the latent
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
        partial = self._project(out, w[f"{a}.o_proj.weight"])  # row-parallel: partial sum
        return self._reduce(partial, w.get(f"{a}.o_proj.bias"))

    def _mlp(self, x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        """SwiGLU MLP; under tp a partial sum (its down bias, if any, is added after the
        all-reduce by the caller)."""
        gate = self._linear(x, w, f"{prefix}.gate_proj")
        up = self._linear(x, w, f"{prefix}.up_proj")
        return self._project(torch.nn.functional.silu(gate) * up, w[f"{prefix}.down_proj.weight"])

    def _dequantized(self, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dtype = w["model.embed_tokens.weight"].dtype  # the bundle's dtype (never quantized)
        out = {}
        for name, tensor in w.items():
            if name.endswith(SCALE):
                continue
            scale = w.get(name + SCALE)
            if scale is not None:
                tensor = dequantize_blocks(tensor, scale, self.cfg.fp8_block, dtype)
            out[name] = tensor
        return out

    def _embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Embedding lookup; with tp > 1 a vocab-parallel one: each rank looks up the ids in its
        rows (others read as zeros) and the all-reduce sums the one non-zero row per token."""
        if self.par.tp == 1:
            return table[ids]
        rows = table.shape[0]
        local = ids - self.rank * rows
        inside = (local >= 0) & (local < rows)
        h = table[local.clamp(0, rows - 1)] * inside.unsqueeze(-1).to(table.dtype)
        return self._reduce(h, None)

    def _head(self, x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab]. With tp > 1 each rank projects onto its vocabulary shard and the
        shards are gathered (placed at the rank's offset, all-reduced: exact, every rank then
        holds the same logits and samples identically, and no collective beyond all-reduce is
        needed by any target's lowering)."""
        logits = self._project(x, head)  # [N, rows]
        if self.par.tp == 1:
            return logits
        mine = (torch.arange(self.par.tp, device=x.device) == self.rank).to(logits.dtype)
        spread = mine.unsqueeze(-1) * logits.unsqueeze(-2)  # [N, tp, rows]: zeros but ours
        return self._reduce(spread, None).flatten(-2)[..., : self.cfg.vocab_size]

    def _project(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return project(x, weight, self.projection)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_weight_in_float32)

    def _linear(self, x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        out = self._project(x, w[f"{prefix}.weight"])
        bias = w.get(f"{prefix}.bias")
        return out if bias is None else out + bias

    def _reduce(self, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Sum row-parallel partial outputs over ranks, then add the (whole) bias once.

        The collective's result feeds the residual add and is never itself a graph output: a
        graph that returns a collective's buffer deadlocks its next call under gloo.
        """
        if self.par.tp > 1:
            import torch.distributed as dist
            from torch.distributed import _functional_collectives as fc

            partial = fc.all_reduce(partial, "sum", dist.group.WORLD)  # string op: picklable
        return partial if bias is None else partial + bias

    def _moe(self, x: torch.Tensor, w: dict[str, torch.Tensor], p: str) -> torch.Tensor:
        """Top-k routed experts over this rank's experts (no all-to-all; models/moe.py).

        Routing is HF's: softmax in float32, top-k, optional renormalisation. Decode graphs
        gather each token's k experts when that reads fewer experts than running them all;
        prefill runs every local expert densely. Partial sums of all ranks are added by the
        same all-reduce as the dense layers.
        """
        cfg = self.cfg
        rows, tokens, hidden = x.shape
        x2 = x.reshape(-1, hidden)  # [N, hidden]
        routing = self._route(x2, w, p)
        gate_up, down = w[f"{p}.moe.gate_up"], w[f"{p}.moe.down"]  # [E_local, 2*I, hidden], ...
        gate_up_b, down_b = w.get(f"{p}.moe.gate_up_bias"), w.get(f"{p}.moe.down_bias")
        local = gate_up.shape[0]
        first: torch.Tensor | int = 0
        if self.rank is not None:  # this rank's experts, chosen by a tensor: SPMD-identical
            # trunc (= floor: ranks are >= 0) stays in integers; floor lowers through float64,
            # which Trainium lacks
            first = torch.div(self.rank, self.par.moe_tp, rounding_mode="trunc") * local
        if self._routed(x2.shape[0], local):
            mine = local_slots(routing, local, first)
            reduce = self.projection.form(x2.shape[0], blocked=False) == "reduction"
            h = gather_rows(x2, gate_up, mine.ids, reduce)  # [N, k, 2*I]
            if gate_up_b is not None:
                h = h + gate_up_b[mine.ids]
            act = self._activate(*h.chunk(2, dim=-1))  # [N, k, I]
            out = gather_rows(act.reshape(-1, act.shape[-1]), down,
                              mine.ids.reshape(-1, 1), reduce)  # fmt: skip
            out = out.reshape(*mine.ids.shape, hidden)  # [N, k, hidden]
            if down_b is not None:
                out = out + down_b[mine.ids]
            out = (out.to(mine.weights.dtype) * mine.weights.unsqueeze(-1)).sum(1).to(x.dtype)
            return self._with_shared(out.reshape(rows, tokens, hidden), x, w, p)
        dense = dense_weights(routing, cfg.num_experts, first, local)  # [N, E_local]
        h = torch.einsum("nh,eih->eni", x2, gate_up)  # [E_local, N, 2*I]
        if gate_up_b is not None:
            h = h + gate_up_b.unsqueeze(1)
        act = self._activate(*h.chunk(2, dim=-1))  # [E_local, N, I]
        out = torch.einsum("eni,ehi->enh", act, down)  # [E_local, N, hidden]
        if down_b is not None:
            out = out + down_b.unsqueeze(1)
        out = torch.einsum("enh,ne->nh", out.to(dense.dtype), dense).to(x.dtype)
        return self._with_shared(out.reshape(rows, tokens, hidden), x, w, p)

    def _with_shared(self, routed, x, w, p):
        """DeepSeek's shared experts run on every token next to the routed ones."""
        if not self.cfg.shared_intermediate_size:
            return routed
        return routed + self._mlp(x, w, f"{p}.moe.shared")

    def _route(self, x2: torch.Tensor, w: dict[str, torch.Tensor], p: str) -> Routing:
        """Each token's experts and weights, as the family's HF router computes them."""
        cfg, k = self.cfg, self.cfg.experts_per_token
        if cfg.router_sigmoid:
            return self._route_grouped(x2, w, p)
        logits = x2 @ w[f"{p}.moe.router"].t()  # [N, E]
        if cfg.router_topk_first:  # GPT-OSS: biased logits, top-k, softmax over the k
            top_v, top_i = torch.topk(logits + w[f"{p}.moe.router_bias"], k, dim=-1)
            return Routing(top_i, torch.softmax(top_v, dim=-1))
        probs = torch.softmax(logits.float(), dim=-1)
        top_w, top_i = torch.topk(probs, k, dim=-1)  # [N, k]
        if cfg.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        if cfg.architecture != "MixtralForCausalLM":
            top_w = top_w.to(x2.dtype)  # Qwen3-MoE casts routing weights; Mixtral keeps float32
        return Routing(top_i, top_w)

    def _route_grouped(self, x2: torch.Tensor, w: dict[str, torch.Tensor], p: str) -> Routing:
        """DeepSeek-V3: sigmoid scores (float32); the selection adds e_score_correction_bias,
        keeps the `topk_group` groups whose two best scores sum highest, and takes the top k
        there; the weights are the unbiased scores, renormalised, times routed_scaling_factor."""
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

    def _activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SwiGLU; GPT-OSS's clamped variant: gate <= limit, |up| <= limit, sigmoid(alpha * gate)
        and (up + 1)."""
        cfg = self.cfg
        if not cfg.swiglu_limit:
            return torch.nn.functional.silu(gate) * up
        gate = gate.clamp(max=cfg.swiglu_limit)
        up = up.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * cfg.swiglu_alpha))

    def _routed(self, num_tokens: int, local: int) -> bool:
        """Gather the routed experts (decode) when that reads fewer than all local experts."""
        return self.shape.phase == "decode" and num_tokens * self.cfg.experts_per_token < local


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """HF's DeepSeek-V3 scaling: 1/sqrt(qk head dim), times yarn's mscale(mscale_all_dim)^2."""
    scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
    params = cfg.rope_params
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params["rope_type"] != "default" and mscale_all_dim:
        mscale = yarn_mscale(params["factor"], mscale_all_dim)
        scale = scale * mscale * mscale
    return scale
