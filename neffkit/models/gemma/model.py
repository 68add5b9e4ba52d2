"""Gemma 2 and Gemma 3 (text): the dense family's graph and shards with Gemma's parts (its config
module says what differs from Llama)."""

from __future__ import annotations

import torch

from neffkit.contract import abi
from neffkit.contract.abi import GraphShape
from neffkit.kernels.norm import rms_norm
from neffkit.kernels.rope import rope_cos_sin
from neffkit.models.forms import PLAIN, ProjectionPolicy
from neffkit.models.gemma.config import GemmaConfig
from neffkit.models.llama.model import LlamaGraph, LlamaShards
from neffkit.models.parallel import Parallelism
from neffkit.models.rope_scaling import rope_frequencies
from neffkit.models.shards import ROPE_LOCAL_INV_FREQ, Named
from neffkit.models.step import Step
from neffkit.targets import E4M3FN_MAX


class GemmaGraph(LlamaGraph):
    cfg: GemmaConfig

    def __init__(
        self,
        cfg: GemmaConfig,
        shape: GraphShape,
        weight_names: list[str],
        max_top_k: int,
        par: Parallelism | None = None,
        projection: ProjectionPolicy = PLAIN,
        fp8_max: float = E4M3FN_MAX,
    ) -> None:
        super().__init__(cfg, shape, weight_names, max_top_k, par, projection, fp8_max)
        self.softcap = cfg.attn_softcap
        local = cfg.local_rope_params
        self.local_attention_factor = rope_frequencies(local, cfg.head_dim)[1] if local else 1.0

    def _step(
        self,
        m: dict[str, torch.Tensor],
        w: dict[str, torch.Tensor],
        rank: torch.Tensor | None,
        caches: tuple[torch.Tensor, ...],
        dtype: torch.dtype,
    ) -> Step:
        step = super()._step(m, w, rank, caches, dtype)
        step.local_rope = self.local_rope(m[abi.POSITIONS], w, dtype)
        return step

    def at_positions(self, step: Step, positions: torch.Tensor) -> Step:
        moved = super().at_positions(step, positions)
        moved.local_rope = self.local_rope(positions, step.w, step.cos.dtype)
        return moved

    def local_rope(
        self, positions: torch.Tensor, w: dict[str, torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sliding layers' own rotation at `positions` (Gemma 3; None: Gemma 2's one)."""
        if ROPE_LOCAL_INV_FREQ not in w:
            return None
        return rope_cos_sin(positions, w[ROPE_LOCAL_INV_FREQ], self.local_attention_factor, dtype)

    def rope(self, layer: int, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        sliding = self.cfg.sliding_windows[layer] is not None
        return step.local_rope if sliding and step.local_rope is not None else (step.cos, step.sin)

    def attention_scale(self) -> float:
        return self.cfg.query_pre_attn_scalar**-0.5

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Gemma's RMSNorm: x * (1 + w), in float32, then cast back."""
        return rms_norm(x, 1.0 + weight.float(), self.cfg.rms_norm_eps, weight_in_float32=True)

    def embed(
        self, ids: torch.Tensor, w: dict[str, torch.Tensor], rank: torch.Tensor | None
    ) -> torch.Tensor:
        """The embedding times sqrt(hidden_size), the scale rounded to the table's dtype first."""
        h = super().embed(ids, w, rank)
        scale = torch.tensor(self.cfg.embed_scale, dtype=h.dtype).item()
        return h * scale

    def layer(self, h: torch.Tensor, layer: int, step: Step) -> torch.Tensor:
        """Norms before and after both attention and the MLP (the after-norms on the branch)."""
        p, w = f"model.layers.{layer}", step.w
        x = self.attention(self.norm(h, w[f"{p}.input_layernorm.weight"]), layer, step)
        h = h + self.norm(x, w[f"{p}.post_attention_layernorm.weight"])
        x = self.norm(h, w[f"{p}.pre_feedforward_layernorm.weight"])
        x = self.feed_forward(x, layer, step)
        return h + self.norm(x, w[f"{p}.post_feedforward_layernorm.weight"])

    def logits(
        self, x: torch.Tensor, head: torch.Tensor, rank: torch.Tensor | None
    ) -> torch.Tensor:
        logits = super().logits(x, head, rank)
        cap = self.cfg.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


class GemmaShards(LlamaShards):
    cfg: GemmaConfig

    def __iter__(self) -> Named:
        yield from super().__iter__()
        local = self.cfg.local_rope_params
        if local:
            yield ROPE_LOCAL_INV_FREQ, rope_frequencies(local, self.cfg.head_dim)[0]

    def layer(self, layer: int) -> Named:
        yield from super().layer(layer)
        p = f"model.layers.{layer}"
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            yield f"{p}.{norm}.weight", self.need(f"{p}.{norm}.weight")
