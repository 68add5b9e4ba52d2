"""Tensor and expert parallel sharding of a checkpoint, done once at build time: the base rules,
in parts a family overrides as its graph overrides the decoder's (decoder.py).

Megatron-style: q/k/v and gate/up are column-parallel (each rank keeps its heads / its slice of the
intermediate dimension), o and down are row-parallel (each rank keeps the matching input columns;
the graph all-reduces their partial outputs). KV heads are split across ranks, or replicated when
tp > num_key_value_heads (rank r keeps KV head r // (tp / kv_heads), the one its query heads use),
so MQA/GQA models run at any tp that divides the query heads. The embedding and LM head are
vocab-parallel (Megatron's VocabParallelEmbedding, as NxDI and vLLM): rank r keeps rows
[r*R, (r+1)*R) with R = ceil(vocab / tp), the last shard zero-padded, so per-rank weight bytes fall
as 1/tp (a 128k vocabulary is 525 MB in bf16); the graph looks up with a mask and all-reduces,
and gathers the logits before sampling (decoder.py). Norms are replicated. Row-parallel biases
are added once, after the all-reduce, so they stay whole.

The order the rules yield tensors in is the graphs' weight-input order (recorded in bundle.json).
They work on any tensors, so shapes come from meta tensors built from safetensors headers and the
very same code cuts the real weights: the graphs and the shards cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from neffkit.errors import ModelError
from neffkit.models.config import ModelConfig
from neffkit.models.forms import KEY_FORMS
from neffkit.models.parallel import Parallelism
from neffkit.models.rope_scaling import rope_frequencies

ROPE_INV_FREQ = "rope.inv_freq"  # a graph input like the weights; float32 in every bundle dtype
ROPE_LOCAL_INV_FREQ = "rope.local_inv_freq"  # the sliding layers' own (Gemma 3)
FP8_SCALE = ".scale"  # `<weight>.scale`: the float32 block scales beside an fp8 weight input
# the rotation an fp8 cache's keys and queries take (kv_cache.rotate_keys: kernels/kv.py)
K_ROTATION = "kv.k_rotation"
FLOAT32_TENSORS = frozenset({ROPE_INV_FREQ, ROPE_LOCAL_INV_FREQ, K_ROTATION})
# DeepSeek's e_score_correction_bias; the fp8 KV cache's per-layer scales and key forms
FLOAT32_SUFFIXES = (
    ".moe.router_score_bias",
    ".self_attn.k_scale",
    ".self_attn.v_scale",
    *(f".self_attn.{name}" for name in KEY_FORMS),
)

Named = Iterator[tuple[str, torch.Tensor]]


def keeps_float32(name: str) -> bool:
    """Tensors the graphs read in float32 whatever the bundle dtype (as HF keeps them)."""
    return name in FLOAT32_TENSORS or name.endswith(FLOAT32_SUFFIXES)


def kv_scale_name(prefix: str, kind: str, available: set[str]) -> str:
    """A layer's K or V cache scale as the checkpoint names it (compressed-tensors puts it on
    the attention module, ModelOpt exports on the projection)."""
    on_projection = f"{prefix}.self_attn.{kind}_proj.{kind}_scale"
    return on_projection if on_projection in available else f"{prefix}.self_attn.{kind}_scale"


class Shards:
    """One rank's (name, tensor) pairs in graph order; a missing tensor is a ModelError.

    `kv_scales`: each layer's k_scale / v_scale (one float each, the fp8 KV cache's
    dequantization scales) follow its attention weights, replicated."""

    def __init__(
        self,
        cfg: ModelConfig,
        par: Parallelism,
        rank: int,
        get: Callable[[str], torch.Tensor],
        available: set[str],
        kv_scales: bool = False,
    ) -> None:
        self.cfg, self.par, self.rank = cfg, par, rank
        self.get, self.available, self.kv_scales = get, available, kv_scales
        d = cfg.head_dim
        self.heads = cfg.num_heads // par.tp  # this rank's query heads
        self.q0 = rank * self.heads * d  # its first query row
        self.k0 = cfg.kv_head_start(par, rank) * d
        self.kv_rows = cfg.kv_heads_per_rank(par) * d
        self.inter = cfg.intermediate_size // par.tp
        self.i0 = rank * self.inter

    def need(self, name: str) -> torch.Tensor:
        if name not in self.available:
            raise ModelError(f"checkpoint is missing tensor {name!r}")
        return self.get(name)

    def __iter__(self) -> Named:
        cfg = self.cfg
        yield "model.embed_tokens.weight", self.vocab_shard(self.need("model.embed_tokens.weight"))
        for layer in range(cfg.num_layers):
            yield from self.layer(layer)
        if self.final_norm:
            yield "model.norm.weight", self.need("model.norm.weight")
        if cfg.lm_head and not cfg.tie_word_embeddings:
            yield "lm_head.weight", self.vocab_shard(self.need("lm_head.weight"))
        # computed, not read: the rope frequencies as HF derives them (float32, never cast)
        yield ROPE_INV_FREQ, rope_frequencies(cfg.rope_params, cfg.head_dim)[0]
        if K_ROTATION in self.available:  # computed by the build (models/weights.py)
            yield K_ROTATION, self.get(K_ROTATION)

    # ------------------------------------------------------------ parts a family overrides
    def layer(self, layer: int) -> Named:
        p = f"model.layers.{layer}"
        yield f"{p}.input_layernorm.weight", self.need(f"{p}.input_layernorm.weight")
        yield from self.attention(p)
        yield from self.kv_scale_tensors(p)
        yield from self.attention_extras(p)
        yield from self.feed_forward_norm(p)
        yield from self.feed_forward(layer, p)

    @property
    def final_norm(self) -> bool:
        """The final norm has a weight (OLMo's has none)."""
        return True

    def kv_scale_tensors(self, p: str) -> Named:
        """The layer's fp8 KV cache scales, where the build asked for them (replicated), and
        the calibrated key forms of this rank's KV heads, where the keys are rotated."""
        if self.kv_scales:
            for kind in ("k", "v"):
                name = kv_scale_name(p, kind, self.available)
                yield f"{p}.self_attn.{kind}_scale", self.need(name).reshape(1)
        for form in KEY_FORMS:
            if f"{p}.self_attn.{form}" in self.available:
                values = self.need(f"{p}.self_attn.{form}").reshape(-1)
                rows = values[self.k0 : self.k0 + self.kv_rows]
                yield f"{p}.self_attn.{form}", rows.reshape(-1, self.cfg.head_dim)

    def attention(self, p: str) -> Named:
        """q, k, v column-parallel (this rank's heads), o row-parallel; biases where present."""
        spans = {
            "q_proj": (self.q0, self.heads * self.cfg.head_dim),
            "k_proj": (self.k0, self.kv_rows),
            "v_proj": (self.k0, self.kv_rows),
        }
        for proj in ("q_proj", "k_proj", "v_proj"):
            yield from self.column(f"{p}.self_attn.{proj}", *spans[proj])
        yield from self.row(f"{p}.self_attn.o_proj", self.q0, self.heads * self.cfg.head_dim)

    def feed_forward_norm(self, p: str) -> Named:
        """The norm between attention and the MLP (Cohere runs both off one norm: none)."""
        yield (
            f"{p}.post_attention_layernorm.weight",
            self.need(f"{p}.post_attention_layernorm.weight"),
        )

    def attention_extras(self, p: str) -> Named:
        """Per-layer attention tensors beyond the projections (q/k norms, sinks): none here."""
        return iter(())

    def feed_forward(self, layer: int, p: str) -> Named:
        """The dense MLP: gate and up column-parallel, down row-parallel."""
        yield from self.column(f"{p}.mlp.gate_proj", self.i0, self.inter)
        yield from self.column(f"{p}.mlp.up_proj", self.i0, self.inter)
        yield from self.row(f"{p}.mlp.down_proj", self.i0, self.inter)

    # ------------------------------------------------------------ cuts
    def column(self, prefix: str, start: int, size: int) -> Named:
        """Output rows [start, start + size) of a projection, and of its bias."""
        yield f"{prefix}.weight", self.need(f"{prefix}.weight")[start : start + size]
        if f"{prefix}.bias" in self.available:
            yield f"{prefix}.bias", self.get(f"{prefix}.bias")[start : start + size]

    def row(self, prefix: str, start: int, size: int) -> Named:
        """Input columns [start, start + size) of a projection; its bias whole (added once,
        after the all-reduce)."""
        yield f"{prefix}.weight", self.need(f"{prefix}.weight")[:, start : start + size]
        if f"{prefix}.bias" in self.available:
            yield f"{prefix}.bias", self.get(f"{prefix}.bias")

    def vocab_shard(self, table: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a [vocab, hidden] table; the last shard zero-padded to full size."""
        cfg, par, rank = self.cfg, self.par, self.rank
        if par.tp == 1:
            return table
        if table.shape[0] != cfg.vocab_size:
            raise ModelError(
                f"embedding/LM head has {table.shape[0]} rows; config.json says vocab_size "
                f"{cfg.vocab_size}"
            )
        rows = cfg.vocab_rows(par)
        part = table[rank * rows : min((rank + 1) * rows, cfg.vocab_size)]
        if part.shape[0] < rows:
            part = torch.cat((part, part.new_zeros((rows - part.shape[0], *table.shape[1:]))))
        return part
