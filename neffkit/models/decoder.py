"""The base decoder: one static-shape paged forward per graph, in parts a family overrides.

A graph is a full forward: embedding, all layers, final norm, LM head, sampling, KV writes. Its
inputs are flat and ordered as the graph ABI (contract/abi.py) lists them: metadata, `rank`
where needed, the KV cache, the decode state, then the weights in the order the family's
sharding rules (shards.py) yield them. Weights as inputs let one copy in memory serve every
graph, and are what neuronx-cc and torch-mlir expect. Nothing here reads a tensor value on the
host: shapes are static per graph.

The parts, each a method a family overrides (mlc-llm's way: Mixtral over Llama replaces the MLP
and nothing else): `embed`, `layer` (norm placement), `attention` (and its `qk_norm`, `sinks`
hooks), `feed_forward`, `mlp` (and `activation`), `norm`, `logits`. As written here they are the
dense Llama family's: pre-norm RMSNorm, GQA attention with RoPE, SwiGLU. What follows the
layers (final norm and LM head through `norm` and `logits`, sampling, prompt logprobs, the verify
step's acceptance) is the same for every family: sampling_head.py's `SamplingHead`, mixed in.
"""

from __future__ import annotations

import math

import torch

from neffkit.contract import abi
from neffkit.contract.abi import GraphShape
from neffkit.contract.kv_groups import group_input
from neffkit.kernels import attention as attn
from neffkit.kernels import lora
from neffkit.kernels.activation import gated
from neffkit.kernels.intquant import PackedWeight, QuantScheme, graph_weights
from neffkit.kernels.kv import from_cache, gather_context, to_cache, write_kv
from neffkit.kernels.norm import rms_norm
from neffkit.kernels.rope import apply_rope, rope_cos_sin
from neffkit.models.config import ModelConfig
from neffkit.models.forms import PLAIN, ProjectionPolicy, takes_projection_form
from neffkit.models.key_offsets import KeyOffsets
from neffkit.models.parallel import Parallelism
from neffkit.models.pooling import pool
from neffkit.models.projection import (
    BlockedFp8,
    fp8_graph_weights,
    materialized,
    out_features,
    project,
    project_many,
)
from neffkit.models.rope_scaling import rope_frequencies
from neffkit.models.sampling_head import SamplingHead
from neffkit.models.shards import FP8_SCALE, K_ROTATION, ROPE_INV_FREQ, keeps_float32
from neffkit.models.step import Span, Step, key_views
from neffkit.targets import E4M3FN_MAX


def int_graph_weights(w: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The graph's weights with each integer / fp4 one's stored parts joined (intquant.py),
    widened to the model's compute dtype (that of its norms: never quantized); projection
    weights (and the tied table) are kept packed for `project` to pick how to read them."""
    schemes = {name: QuantScheme.from_id(s) for name, s in cfg.weight_quant}
    dtype = next(
        t.dtype
        for n, t in w.items()
        if t.is_floating_point() and not keeps_float32(n) and n.endswith("norm.weight")
    )
    return graph_weights(w, schemes, dtype, takes_projection_form)  # type: ignore[return-value]


def lookup(table: torch.Tensor | PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows of an embedding table, plain [vocab, H] or blocked [vocab/L, H, L] (a tied table
    stored for the LM head's blocked forms: forms.blocks), or quantized (only its rows read
    are widened)."""
    if isinstance(table, PackedWeight):
        return table.rows(ids)
    if table.dim() == 2:
        return table[ids]
    lanes = table.shape[2]
    return table[ids // lanes, :, ids % lanes]  # [..., H]


class DecoderGraph(KeyOffsets, SamplingHead, torch.nn.Module):
    """forward(*flat_inputs) → the tensors `abi.graph_outputs` lists (next tokens and logprobs);
    K/V caches are mutated in place (io-aliased)."""

    def __init__(
        self,
        cfg: ModelConfig,
        shape: GraphShape,
        weight_names: list[str],
        max_top_k: int,
        par: Parallelism | None = None,
        projection: ProjectionPolicy = PLAIN,
        fp8_max: float = E4M3FN_MAX,
    ) -> None:
        super().__init__()
        self.fp8_max = fp8_max  # the range fp8 cache values are clamped to (targets.fp8_max)
        self.cfg = cfg
        self.shape = shape
        self.weight_names = weight_names
        self.meta_names = [spec.name for spec in abi.metadata_inputs(shape)]
        self.max_top_k = max_top_k
        self.par = par or Parallelism()
        self.has_rank = cfg.needs_rank_input(self.par)
        self.projection = projection
        self.rope_attention_factor = rope_frequencies(cfg.rope_params, cfg.head_dim)[1]
        self.caches_per_layer = len(abi.KV_KINDS[cfg.kv_kind])
        # attention through neffkit::paged_decode_attention (forms.ProjectionPolicy)
        self.attention_kernel = projection.attends_in_kernel(shape.phase, shape.rows)
        # adapters of decode and verify rows through neffkit::lora_rows (kernels/lora.py)
        self.lora_kernel = projection.lora_kernel and not shape.rule.packed

    # ------------------------------------------------------------ the forward
    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg, shape = self.cfg, self.shape
        num_meta = len(self.meta_names)
        m = dict(zip(self.meta_names, flat[:num_meta], strict=True))
        rest = flat[num_meta:]
        rank = rest[0] if self.has_rank else None  # [1] int64: this graph's rank, as data
        rest = rest[1:] if self.has_rank else rest
        n_caches = self.caches_per_layer * cfg.num_layers
        caches, rest = rest[:n_caches], rest[n_caches:]
        last_tokens = rest[0] if shape.device_state else None  # [num_blocks] int64, aliased
        rest = rest[1:] if shape.device_state else rest
        w = dict(zip(self.weight_names, rest, strict=True))
        if cfg.fp8_block:  # block fp8 weights: widened right before use (kernels/quant.py)
            w = fp8_graph_weights(w, self.cfg.fp8_block, FP8_SCALE)
        if cfg.weight_quant:  # integer / fp4 weights: widened next to their matmul
            w = int_graph_weights(w, cfg)
        if shape.adapters:  # each token's adapter slot, for every adapted projection
            slots, seq_ids = m[abi.LORA_SLOTS], m.get(abi.SEQ_IDS)
            lora.step_inputs(w, slots, seq_ids, shape.tokens, self.lora_kernel)
        state_slots = None
        if last_tokens is not None:  # clamped like every index from the host (audit NK303)
            state_slots = m[abi.SEQ_SLOTS].clamp(0, last_tokens.shape[0] - 1)
        if abi.INPUT_IDS in m:
            input_ids = m[abi.INPUT_IDS]
        else:  # device state: each row's token is the one the last step stored for its sequence
            assert last_tokens is not None and state_slots is not None
            input_ids = last_tokens.index_select(0, state_slots).unsqueeze(1)  # [B, 1]

        # Ids are validated on the host; the clamp is defence in depth: an out-of-range gather is
        # an out-of-bounds DMA on Neuron and a crash on CPU (audit rule NK109).
        ids = input_ids.clamp(0, cfg.vocab_size - 1)
        h = self.prelude(self.embed(ids, w, rank), m, w)  # [B, T, hidden]
        step = self._step(m, w, rank, caches, h.dtype)
        for layer in range(cfg.num_layers):
            h = self.layer(h, layer, step)
        if shape.pooling:  # an embed bundle: each sequence's final states, pooled
            return (pool(self.final_norm(h, w)[0], m[abi.LAST_TOKEN_INDEX], shape.pooling),)
        sampled, prompt = self._sample(h, m, w, rank)
        if last_tokens is not None:  # the next decode step's input, stored on the device
            # padding rows all write the padding slot 0, which no sequence reads
            last = sampled[0]
            if shape.rule.samples_every_position:  # each row's last emitted token
                last = last.gather(1, (sampled[1] - 1).clamp(0, shape.tokens - 1).unsqueeze(1))
                last = last.squeeze(1)
            last_tokens.index_put_((state_slots,), last)
        return (*sampled, *prompt, *self._hidden(h))

    def _hidden(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The last layer's output before the final norm, where the graph returns it (what an
        MTP layer predicts from): decode [B, H], verify [B, T, H], prefill [T, H]."""
        if not self.shape.hidden_out:
            return ()
        rule = self.shape.rule
        out = h[0] if rule.packed else h if rule.samples_every_position else h[:, -1]
        return (out.float(),)

    def _step(
        self,
        m: dict[str, torch.Tensor],
        w: dict[str, torch.Tensor],
        rank: torch.Tensor | None,
        caches: tuple[torch.Tensor, ...],
        dtype: torch.dtype,
    ) -> Step:
        """RoPE, the masks (one per distinct window) and the slots every layer shares."""
        cfg, shape = self.cfg, self.shape
        positions = m[abi.POSITIONS]
        context_lens, seq_ids = m[abi.CONTEXT_LENS], m.get(abi.SEQ_IDS)
        cos, sin = rope_cos_sin(
            positions, w[ROPE_INV_FREQ], self.rope_attention_factor, dtype
        )  # [B, T, 1, D]
        groups = max(1, len(shape.group_blocks))  # KV groups: each its own tables and slots
        tables = [m[group_input(abi.BLOCK_TABLES, g)] for g in range(groups)]
        # per distinct span, in order: the KV group of its layers (one group per span)
        spans = {self.span(layer): self.kv_group(layer) for layer in range(cfg.num_layers)}
        rows = (positions, seq_ids, context_lens, shape.context)
        masks, bounds, tables = key_views(rows, tables, spans, self.attention_kernel)
        slots = [m[group_input(abi.SLOT_MAPPING, g)].reshape(-1) for g in range(groups)]
        step = Step(
            w=w,
            rank=rank,
            caches=tuple(caches),
            cos=cos,
            sin=sin,
            masks=masks,
            group_slots=tuple(slots),
            group_tables=tuple(tables),
            positions=positions,
            bounds=bounds,
        )
        if K_ROTATION in w:  # fp8 rotated keys: their offsets at the context's positions
            step.context = self.context_step(step, packed=seq_ids is not None)
        return step

    # ------------------------------------------------------------ parts a family overrides
    def prelude(
        self, h: torch.Tensor, m: dict[str, torch.Tensor], w: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """What the layers receive from the embeddings: the embeddings here (DeepSeek's MTP
        layer mixes in the previous hidden state)."""
        return h

    def layer(self, h: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        """One decoder layer, pre-norm: h + attention(norm(h)), then h + feed_forward(norm(h))."""
        p, w = f"model.layers.{layer}", step.w
        x = self.norm(h, w[f"{p}.input_layernorm.weight"])
        h = h + self.attention(x, layer, step)
        x = self.norm(h, w[f"{p}.post_attention_layernorm.weight"])
        return h + self.feed_forward(x, layer, step)

    def attention(self, x: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        """GQA over the paged K/V cache: project, RoPE, write this step's K/V, attend."""
        cfg, w, p = self.cfg, step.w, f"model.layers.{layer}"
        k_cache, v_cache = step.caches[2 * layer], step.caches[2 * layer + 1]
        rows, tokens, _ = x.shape
        kv_heads = k_cache.shape[2]
        heads = out_features(w[f"{p}.self_attn.q_proj.weight"]) // cfg.head_dim
        q, k, v = self.linears(x, w, tuple(f"{p}.self_attn.{n}_proj" for n in "qkv"))
        q = q.view(rows, tokens, heads, cfg.head_dim)
        k = k.view(rows, tokens, kv_heads, cfg.head_dim)
        v = v.view(rows, tokens, kv_heads, cfg.head_dim)
        q, k = self.qk_norm(q, k, w, p)
        q, k = self.positional(q, k, layer, step)
        q_rope = q
        if K_ROTATION in w:  # an fp8 cache's keys, centered and rotated (kv_cache.rotate_keys)
            q, k = self.stored_forms(q, k, layer, step)
        k_scale, v_scale = w.get(f"{p}.self_attn.k_scale"), w.get(f"{p}.self_attn.v_scale")
        fp8_max = self.fp8_max
        write_kv(
            k_cache,
            v_cache,
            to_cache(k.reshape(-1, kv_heads, cfg.head_dim), k_cache.dtype, fp8_max, k_scale),
            to_cache(v.reshape(-1, kv_heads, cfg.head_dim), v_cache.dtype, fp8_max, v_scale),
            step.group_slots[self.kv_group(layer)],
        )
        if step.bounds is not None:  # cpu: neffkit's kernel reads only the visible keys
            bounds, sinks = step.bounds[self.span(layer)], self.sinks(w, p)
            out = attn.kernel_attention(
                q, k_cache, v_cache, bounds, self.attention_scale(), sinks, self.softcap
            )
        else:
            tables = step.group_tables[self.kv_group(layer)]
            keys = from_cache(gather_context(k_cache, tables), q.dtype, k_scale)
            values = from_cache(gather_context(v_cache, tables), q.dtype, v_scale)
            bias = None
            if step.context is not None:  # rotated keys: each context key's offset added back
                bias = self.offset_bias(q_rope, layer, step)
            if self.projection.buffer_queries:
                q = materialized(q)
            mask = step.masks[self.span(layer)]
            out = attn.paged_attention(
                q, keys, values, mask, self.attention_scale(), self.sinks(w, p), self.softcap, bias
            )
        o_proj = f"{p}.self_attn.o_proj"
        partial = self.adapt(out, w, o_proj, self.project(out, w[f"{o_proj}.weight"]))  # row-par.
        return self.reduce(partial, w.get(f"{p}.self_attn.o_proj.bias"))

    def qk_norm(
        self, q: torch.Tensor, k: torch.Tensor, w: dict[str, torch.Tensor], p: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norms on q and k before RoPE (none here; Qwen3's per-head RMSNorm in the family)."""
        return q, k

    def positional(
        self, q: torch.Tensor, k: torch.Tensor, layer: int, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where positions enter q and k: RoPE on every layer here (Llama 4: NoPE layers)."""
        cos, sin = self.rope(layer, step)
        return self.rotary(q, cos, sin), self.rotary(k, cos, sin)

    def kv_group(self, layer: int) -> int:
        """The KV group whose pool, tables and slots layer `layer` uses (contract/kv_groups)."""
        return self.shape.layer_group[layer] if self.shape.layer_group else 0

    def span(self, layer: int) -> Span:
        """The keys layer `layer` sees: its sliding window (None: all), no chunking here."""
        return self.cfg.sliding_windows[layer], None

    # tanh soft-capping of the attention scores (Gemma 2): none here
    softcap: float | None = None
    # how q and k are rotated: rotate-half here (Cohere: interleaved pairs)
    rotary = staticmethod(apply_rope)

    def attention_scale(self) -> float:
        """What q·k is multiplied by: 1/sqrt(head_dim) here."""
        return 1.0 / math.sqrt(self.cfg.head_dim)

    def rope(self, layer: int, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin layer `layer` rotates q and k by: one set for every layer here."""
        return step.cos, step.sin

    def sinks(self, w: dict[str, torch.Tensor], p: str) -> torch.Tensor | None:
        """A learned logit per head in each softmax denominator (GPT-OSS); none here."""
        return None

    def feed_forward(self, x: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        """The layer's MLP, all-reduced under tp (its down bias, if any, added once after)."""
        prefix = f"model.layers.{layer}.mlp"
        return self.reduce(self.mlp(x, step.w, prefix), step.w.get(f"{prefix}.down_proj.bias"))

    def mlp(self, x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        """Gated MLP; under tp a partial sum."""
        gate, up = self.linears(x, w, (f"{prefix}.gate_proj", f"{prefix}.up_proj"))
        h, down = self.activation(gate, up), f"{prefix}.down_proj"
        return self.adapt(h, w, down, self.project(h, w[f"{down}.weight"]))

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, act the config's `hidden_act` (SwiGLU for most checkpoints)."""
        return gated(self.cfg.hidden_act, gate, up)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.cfg.rms_norm_eps)

    def final_norm(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """The norm before the LM head (its weight where Shards.final_norm reads one)."""
        return self.norm(x, w["model.norm.weight"])

    def embed(
        self, ids: torch.Tensor, w: dict[str, torch.Tensor], rank: torch.Tensor | None
    ) -> torch.Tensor:
        """Embedding lookup; with tp > 1 a vocab-parallel one: each rank looks up the ids in its
        rows (others read as zeros) and the all-reduce sums the one non-zero row per token."""
        table = w["model.embed_tokens.weight"]
        if self.par.tp == 1:
            return lookup(table, ids)
        rows = out_features(table)
        assert rank is not None  # tp > 1 graphs take their rank (needs_rank_input)
        local = ids - rank * rows
        inside = (local >= 0) & (local < rows)
        h = lookup(table, local.clamp(0, rows - 1)) * inside.unsqueeze(-1).to(table.dtype)
        return self.reduce(h, None)

    def logits(
        self, x: torch.Tensor, head: torch.Tensor, rank: torch.Tensor | None
    ) -> torch.Tensor:
        """Logits [N, vocab]. With tp > 1 each rank projects onto its vocabulary shard and the
        shards are gathered (placed at the rank's offset, all-reduced: exact, every rank then
        holds the same logits and samples identically, and no collective beyond all-reduce is
        needed by any target's lowering)."""
        logits = self.project(x, head)  # [N, rows]
        if self.par.tp == 1:
            return logits
        assert rank is not None  # tp > 1 graphs take their rank (needs_rank_input)
        mine = (torch.arange(self.par.tp, device=x.device) == rank).to(logits.dtype)
        spread = mine.unsqueeze(-1) * logits.unsqueeze(-2)  # [N, tp, rows]: zeros but ours
        return self.reduce(spread, None).flatten(-2)[..., : self.cfg.vocab_size]

    # ------------------------------------------------------------ shared helpers
    def project(self, x: torch.Tensor, weight: torch.Tensor | BlockedFp8) -> torch.Tensor:
        return project(x, weight, self.projection)

    def linear(self, x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        return self.linears(x, w, (prefix,))[0]

    def linears(
        self, x: torch.Tensor, w: dict[str, torch.Tensor], prefixes: tuple[str, ...]
    ) -> list[torch.Tensor]:
        """Projections of one input, biases added: one kernel call where it takes them all."""
        outs = project_many(x, [w[f"{p}.weight"] for p in prefixes], self.projection)
        outs = lora.adapted(x, w, prefixes, outs)
        biases = [w.get(f"{p}.bias") for p in prefixes]
        return [out if bias is None else out + bias for out, bias in zip(outs, biases, strict=True)]

    def adapt(
        self, x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, out: torch.Tensor
    ) -> torch.Tensor:
        """`out` plus x through each token's adapter, where `prefix` has slots (`lora:`); under
        tp a row-parallel one's delta is a partial sum too, reduced with `out`."""
        return lora.adapted(x, w, (prefix,), [out])[0]

    def reduce(self, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Sum row-parallel partial outputs over ranks, then add the (whole) bias once.

        The collective's result feeds the residual add and is never itself a graph output: a
        graph that returns a collective's buffer deadlocks its next call under gloo.
        """
        if self.par.tp > 1:
            import torch.distributed as dist
            from torch.distributed import _functional_collectives as fc

            world = dist.group.WORLD  # set: tp > 1 runs in a process group (tracing: a fake one)
            assert world is not None
            partial = fc.all_reduce(partial, "sum", world)  # string op: picklable
        return partial if bias is None else partial + bias
