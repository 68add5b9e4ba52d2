"""Mixture-of-experts helpers over one rank's stacked experts: routing, then the experts either
densely or by gathering only the routed ones.

Dense (prefill): every local expert runs on every token, weighted by its routing weight (0 when
not selected): big matmuls, no gather. Routed (decode): each token's top-k experts' weights are
gathered by index (static shapes: `[tokens, k, ...]`), so a decode step reads k experts per token,
not all of them: bytes per token scale with k, not with the number of experts. Under expert
parallelism a rank gathers among its own experts and weights the others' slots with 0 (the
index is clamped into range, so every rank's graph is the same graph: SPMD); the ranks' partial
sums meet in the layer's all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Routing:
    """Each token's k experts (global ids) and their weights."""

    ids: torch.Tensor  # [N, k] int64
    weights: torch.Tensor  # [N, k]


def local_slots(routing: Routing, local: int, first: torch.Tensor | int) -> Routing:
    """Routing as this rank sees it: ids among its `local` experts (from `first`), weight 0 for
    experts another rank holds."""
    ids = routing.ids - first
    mine = (ids >= 0) & (ids < local)
    weights = torch.where(mine, routing.weights, torch.zeros_like(routing.weights))
    return Routing(ids.clamp(0, local - 1), weights)


def dense_weights(
    routing: Routing, num_experts: int, first: torch.Tensor | int, local: int
) -> torch.Tensor:
    """[N, local] routing weights of this rank's experts (0 where not routed)."""
    n = routing.ids.shape[0]
    full = torch.zeros(n, num_experts, dtype=routing.weights.dtype, device=routing.ids.device)
    full = full.scatter(1, routing.ids, routing.weights)
    if isinstance(first, int) and first == 0 and local == num_experts:
        return full
    # clamped: `first` comes from the rank input, and an index past the experts would be an
    # out-of-bounds DMA on Neuron (audit NK303)
    ids = (first + torch.arange(local, device=routing.ids.device)).clamp(0, num_experts - 1)
    return full.index_select(1, ids)


def gather_rows(
    x: torch.Tensor,  # [N, in]
    weights: torch.Tensor,  # [E, out, in]
    ids: torch.Tensor,  # [N, k]
    as_reduction: bool,
) -> torch.Tensor:  # [N, k, out]
    """Each token times its k experts' matrices, reading only those experts.

    As a reduction (Inductor targets) the gather becomes indirect loads inside the one fused
    kernel that streams each chosen expert's rows once; otherwise an explicit gather and a
    batched matmul (the form a TensorEngine takes).
    """
    if as_reduction:
        return (x[:, None, None, :] * weights[ids]).sum(-1)
    chosen = weights.index_select(0, ids.reshape(-1))  # [N*k, out, in]
    k = ids.shape[1]
    xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [N*k, in, 1]
    return torch.bmm(chosen, xs).squeeze(-1).reshape(x.shape[0], k, -1)
