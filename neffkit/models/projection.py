"""How a graph writes `x @ weight.T`, and the blocked weight layout the CPU forms read.

A decode step is bandwidth-bound: each projection should stream its weight once, whatever the
number of rows. On the CPU, Inductor's fused C++ reductions do that at one row; with several rows
a plain-layout reduction streams the weight once per row, and `mm` (oneDNN/MKL) reads it at
~12 GB/s here. The forms below read a *blocked* weight, stored in the bundle as
[out/LANES, in, LANES] (still a plain strided graph input, one copy for every graph):

- "blocked-rows" (decode, up to `max_rows` rows): one reduction per row over the same weight
  tile; Inductor fuses them into one loop whose body loads a LANES-wide weight vector once and
  feeds every row's accumulator (a register-blocked GEMV: bench/batch.py, LAB.md).
- "blocked-bmm" (prefill, larger buckets, without the kernel): `matmul` against the blocks, a
  bmm of [T, in] x [in, LANES] per block (as fast as `mm` at 128 rows on the Intel host).

- "kernel-rows" (cpu with AVX2 or AVX-512, any number of rows): neffkit's own C++ kernel on the same
  blocked weights (neffkit/platform/csrc/blocked_rows.cpp): each weight vector, loaded once
  (bf16 widened in register), feeds every row's accumulator held in registers, with the weight
  lines prefetched ahead; Inductor's reductions keep neither the rows nor the stream that way.
  bf16 rows on bf16 weights use AMX tiles where the CPU has them, else VDPBF16PS. Groups of 8
  rows over the same tile make it a GEMM for prefill too, 2.5x or more Inductor's bmm over the
  blocks here (whose 16-lane blocks are narrow GEMMs). Called through the dispatcher (~3 us a
  call), so "auto" takes it only for weights of at least `kernel_min_bytes`, at the row counts
  where the build measured it faster; the manifest's `compiler.cpu_kernel` says on/off/auto.

Other forms: "reduction" (plain layout, a single row, the original GEMV form), "mm", and "dot"
(neuron: neuronx-cc needs the `dot` to put a projection on the TensorEngine).

Integer and fp4 weights stay at their storage width in the graph (intquant.PackedWeight) and
take their own forms (`ProjectionPolicy.packed_form`, `project_packed`): decode rows read the
codes in place, through "kernel-packed" (neffkit::packed_rows, csrc/packed_rows.cpp: 4- and
8-bit, float32) or "packed-rows" (Inductor's fused reduction); more rows widen the weight first.
W8A8 weights (intquant.Int8Activations) quantize the rows per token, then "kernel-int8"
(neffkit::int8_rows, csrc/int8_rows.cpp: int8 dot products summed in int32, any row count) where
the kernel library is in use, else a float32 matmul of the integer values in the graph. Integer
weights with int8 activations per block (the manifest's opt-in, kernels/int8_blocks.py) take
"kernel-int8" too (neffkit::int8_blocks), else the weight-only forms on the quantized rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from neffkit.kernels.int8_blocks import (
    blocks_kernel_reads,
    fake_quantized,
    project_int8_blocks_kernel,
)
from neffkit.kernels.intquant import (
    SCALE,
    Int8Activations,
    PackedWeight,
    int8_kernel_reads,
    kernel_table,
    nibble_halves,
    project_w8a8,
    project_w8a8_kernel,
)
from neffkit.kernels.quant import dequantize_blocked, dequantize_blocks
from neffkit.models.forms import ProjectionPolicy, packs_to_kernel


@dataclass(frozen=True)
class BlockedFp8:
    """A blocked fp8 projection weight [out/L, in, L] with its `lane_scales` [out/L, KB, L]:
    decode rows read its bytes in the kernel (`blocked_rows_fp8`); other forms dequantize."""

    weight: torch.Tensor
    scales: torch.Tensor
    k_block: int

    @classmethod
    def of(cls, weight: torch.Tensor, scales: torch.Tensor, k_block: int) -> BlockedFp8:
        """From a checkpoint's K block size, where 0 (per-channel, per-tensor) is the whole K."""
        return cls(weight, scales, k_block or weight.shape[1])


def fp8_graph_weights(
    w: dict[str, torch.Tensor], block: tuple[int, ...], scale_suffix: str
) -> dict[str, Any]:
    """A graph's weights with each fp8 one joined to its scales (`<name><scale_suffix>`): plain
    ones widened here, right before use; blocked ones (cpu projections) kept as fp8 with their
    lane scales, for `project` to read in the kernel (`BlockedFp8`)."""
    dtype = w["model.embed_tokens.weight"].dtype  # the bundle's dtype (never quantized)
    out: dict[str, Any] = {}
    for name, tensor in w.items():
        if name.endswith(scale_suffix):
            continue
        scale = w.get(name + scale_suffix)
        if scale is not None and tensor.dim() == 3:
            out[name] = BlockedFp8.of(tensor, scale, block[1])
        elif scale is not None:
            out[name] = dequantize_blocks(tensor, scale, block, dtype)
        else:
            out[name] = tensor
    return out


def to_blocked(weight: torch.Tensor, lanes: int) -> torch.Tensor:
    """[out, in] → [out/lanes, in, lanes], contiguous: lane j of block b is output b*lanes + j."""
    out_features, in_features = weight.shape
    return weight.reshape(out_features // lanes, lanes, in_features).transpose(1, 2).contiguous()


def from_blocked(weight: torch.Tensor) -> torch.Tensor:
    """The plain [out, in] weight again (tests, tools)."""
    nb, in_features, lanes = weight.shape
    return weight.transpose(1, 2).reshape(nb * lanes, in_features)


Weight = torch.Tensor | BlockedFp8 | Int8Activations | PackedWeight


def out_features(weight: Weight) -> int:
    """A projection weight's output size, plain or blocked."""
    if isinstance(weight, Int8Activations | PackedWeight):
        return weight.out_features
    if isinstance(weight, BlockedFp8):
        weight = weight.weight
    return weight.shape[0] * weight.shape[2] if weight.dim() == 3 else weight.shape[0]


def materialized(x: torch.Tensor) -> torch.Tensor:
    """x, stored once in its own buffer by Inductor before the projection reads it.

    Otherwise Inductor inlines the producer (the RMSNorm, SwiGLU) into the reduction's inner
    loop, recomputing it for every weight tile (the LM head of a 125M model, 8 rows: ~30 ms a
    step), or realises the whole [tiles, in, lanes] product (bf16: 0.5 GB a step). An identity
    `as_strided` is the one view Inductor's lowering must realise its input for; eagerly it is
    a free view."""
    x = x.contiguous()
    return torch.as_strided(x, x.shape, x.stride())


def project(x: torch.Tensor, weight: Weight, policy: ProjectionPolicy) -> torch.Tensor:
    """x @ weight.T for a plain [out, in] or blocked [out/L, in, L] weight (module docstring)."""
    return project_many(x, [weight], policy)[0]


def project_many(
    x: torch.Tensor, weights: Sequence[Weight], policy: ProjectionPolicy
) -> list[torch.Tensor]:
    """x @ w.T for each weight reading the same x (a layer's q/k/v, its gate/up): one kernel
    call where every one takes the kernel form and all are one kind, so one parallel region
    streams them all (csrc/blocked_rows.cpp says what a region costs); else one by one.

    Weight-only integer and fp4 weights arrive as their stored parts (`PackedWeight`), read
    in the form `policy.packed_form` picks (`project_packed`); W8A8 weights (`Int8Activations`)
    quantize the rows first, all in one neffkit::int8_rows call where `policy.int8_form` is
    "kernel-int8"."""
    floats = [w for w in weights if not isinstance(w, Int8Activations | PackedWeight)]
    if len(floats) < len(weights):
        int8 = [w for w in weights if isinstance(w, Int8Activations) and _int8_kernel(x, w, policy)]
        if len(int8) == len(weights):
            return project_w8a8_kernel(x, int8)
        packed = [w for w in weights if isinstance(w, PackedWeight)]
        if len(packed) == len(weights) and _blocks_kernel(x, packed, policy):
            return project_int8_blocks_kernel(x, packed)
        if len(packed) == len(weights) and _one_packed_call(x, packed, policy):
            return project_packed_kernel(_weight_only_rows(x, packed[0]), packed)
        return [_project_one(x, w, policy) for w in weights]
    return _project_floats(x, floats, policy)


def _project_one(x: torch.Tensor, weight: Weight, policy: ProjectionPolicy) -> torch.Tensor:
    if isinstance(weight, Int8Activations):
        if _int8_kernel(x, weight, policy):
            return project_w8a8_kernel(x, [weight])[0]
        return project_w8a8(x, weight)
    if isinstance(weight, PackedWeight):
        return project_packed(x, weight, policy)
    return project(x, weight, policy)


def _int8_kernel(x: torch.Tensor, weight: Int8Activations, policy: ProjectionPolicy) -> bool:
    """Does this W8A8 weight take neffkit::int8_rows at x's row count (forms.int8_form)?"""
    rows = x.numel() // x.shape[-1]
    return policy.int8_form(rows) == "kernel-int8" and int8_kernel_reads(weight)


def _blocks_kernel(
    x: torch.Tensor, weights: Sequence[PackedWeight], policy: ProjectionPolicy
) -> bool:
    """Do these int8-block weights (one scheme) take neffkit::int8_blocks at x's row count?"""
    rows = x.numel() // x.shape[-1]
    reads = all(blocks_kernel_reads(w) for w in weights) and len({w.scheme for w in weights}) == 1
    return reads and policy.int8_form(rows) == "kernel-int8"


def _weight_only_rows(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """The rows a weight-only form multiplies: an int8-block weight's quantized and dequantized
    per block (kernels/int8_blocks.py), else x."""
    return fake_quantized(x) if weight.scheme.activations == "int8-block" else x


def project_packed(x: torch.Tensor, weight: PackedWeight, policy: ProjectionPolicy) -> torch.Tensor:
    """x @ W.T for a weight kept at its storage width, in the form the policy picks for the
    row count (forms.ProjectionPolicy.packed_form):

    - "packed-rows": the rows in float32, stored once (`materialized`: else Inductor inlines
      the RMSNorm before the projection into the reduction, per weight row), then one
      reduction per row that widens the codes as it reads them; Inductor fuses the rows' into
      one loop over the codes. A 4-bit weight is read as its two nibble halves against the
      rows' even and odd inputs (`nibble_halves`), so each byte is loaded once and the loop
      is a vector loop. Every weight value is exactly `dequantize`'s; only the order of the
      float32 sum differs, as between any two reductions.
    - "kernel-packed": neffkit::packed_rows (`project_packed_kernel`).
    - otherwise ("mm", "dot"): widened in the graph, then the float forms.

    An int8-block weight takes "kernel-int8" (neffkit::int8_blocks) where `int8_form` says so,
    else the forms above on its quantized rows (`_weight_only_rows`)."""
    if _blocks_kernel(x, [weight], policy):
        return project_int8_blocks_kernel(x, [weight])[0]
    x = _weight_only_rows(x, weight)
    lead, in_features = x.shape[:-1], x.shape[-1]
    rows = x.numel() // in_features
    form = policy.packed_form(rows, kernel_reads(weight))
    if form == "kernel-packed":
        return project_packed_kernel(x, [weight])[0]
    halves = nibble_halves(weight.parts, weight.scheme, weight.dtype) if form != "dot" else None
    if form == "mm" and halves is not None:
        # the even inputs times the low nibbles' values plus the odd ones times the high ones:
        # no buffer of codes unpacked in between (Inductor's `cat`), each half widened by a
        # vector loop; the sum of two half-K products is another order of the same sum
        xs = x.unflatten(-1, (in_features // 2, 2))
        return xs[..., 0] @ halves[0].t() + xs[..., 1] @ halves[1].t()
    if form != "packed-rows":
        return _graph_form(x, weight.widened(), policy)
    x2 = materialized(x.reshape(rows, in_features).float())
    if halves is None:
        w = weight.widened().float()
        per_row = [(x2[r] * w).sum(-1) for r in range(rows)]
    else:
        low, high = (h.float() for h in halves)
        # [rows, 2, in/2]: each row's even inputs, then its odd ones, contiguous
        xs = materialized(x2.unflatten(-1, (in_features // 2, 2)).transpose(1, 2))
        per_row = [(xs[r, 0] * low + xs[r, 1] * high).sum(-1) for r in range(rows)]
    out = torch.stack(per_row).to(x.dtype)
    return out.reshape(*lead, out.shape[-1])


def kernel_reads(weight: PackedWeight) -> bool:
    """Does neffkit::packed_rows read this weight (forms.packs_to_kernel; float32 values)?"""
    codes, scheme = weight.parts[""], weight.scheme
    if scheme.bits not in (4, 8) or codes.dim() != 2 or weight.dtype != torch.float32:
        return False
    in_features = codes.shape[-1] * 8 // scheme.bits
    weight_only = scheme.activations != "int8-token"  # int8-block: on its quantized rows
    return packs_to_kernel(scheme.bits, scheme.group, in_features, weight_only)


def _one_packed_call(
    x: torch.Tensor, weights: Sequence[PackedWeight], policy: ProjectionPolicy
) -> bool:
    """Do these weights all take the kernel form at x's row count, under one scheme (what one
    call reads: one parallel region for a layer's q/k/v)?"""
    rows = x.numel() // x.shape[-1]
    kernel = all(policy.packed_form(rows, kernel_reads(w)) == "kernel-packed" for w in weights)
    return kernel and len({w.scheme for w in weights}) == 1


def project_packed_kernel(x: torch.Tensor, weights: Sequence[PackedWeight]) -> list[torch.Tensor]:
    """x @ W.T for each 4- or 8-bit weight, one neffkit::packed_rows call (csrc/packed_rows.cpp):
    every value exactly `dequantize`'s (4-bit: each group's 16 values computed once, then
    selected per code); float32 rows and accumulation, one cast per output."""
    lead, in_features = x.shape[:-1], x.shape[-1]
    x2 = materialized(x.reshape(-1, in_features).float())
    scheme = weights[0].scheme
    base, mode = kernel_table(scheme, x.device)
    codes, scales = [w.parts[""] for w in weights], [w.parts[SCALE] for w in weights]
    # mode 0 reads no aux: the scales stand in (AOTInductor passes an empty list on as None)
    aux = [w.parts[scheme.aux] for w in weights] if scheme.aux else scales
    out = torch.ops.neffkit.packed_rows(x2, codes, scales, aux, base, mode)
    parts = out.split([w.out_features for w in weights], dim=-1)
    return [part.to(x.dtype).reshape(*lead, part.shape[-1]) for part in parts]


def _project_floats(
    x: torch.Tensor, weights: Sequence[torch.Tensor | BlockedFp8], policy: ProjectionPolicy
) -> list[torch.Tensor]:
    lead, in_features = x.shape[:-1], x.shape[-1]
    rows = x.numel() // in_features
    if not _one_kernel_call(weights, rows, policy):
        if len(weights) > 1:
            return [project_many(x, [w], policy)[0] for w in weights]
        return [_graph_form(x, weights[0], policy)]
    x2 = x.reshape(rows, in_features)
    first = weights[0]
    if isinstance(first, BlockedFp8):
        # bf16 rows as they are (the kernel's VDPBF16PS path reads them), others float32
        x2 = materialized(x2 if x.dtype == torch.bfloat16 else x2.float())
        fp8 = [w for w in weights if isinstance(w, BlockedFp8)]
        out = torch.ops.neffkit.blocked_rows_fp8(
            x2, [w.weight for w in fp8], [w.scales for w in fp8], first.k_block
        )
    else:
        # float32 accumulation, one cast per output; bf16 rows stay bf16 on bf16 weights
        # (the kernel's AMX and VDPBF16PS paths read them as they are), others go to float32
        x2 = materialized(x2 if x.dtype == first.dtype == torch.bfloat16 else x2.float())
        out = torch.ops.neffkit.blocked_rows(x2, list(weights))  # float32 [rows, sum of out]
    parts = out.split([out_features(w) for w in weights], dim=-1)
    return [part.to(x.dtype).reshape(*lead, part.shape[-1]) for part in parts]


def _one_kernel_call(
    weights: Sequence[torch.Tensor | BlockedFp8], rows: int, policy: ProjectionPolicy
) -> bool:
    """Do these weights take the kernel form at `rows`, all fp8 of one K block or all of one
    float dtype (what one call of one op reads)?"""
    kinds: set[tuple[str, int | torch.dtype]] = set()
    kind: tuple[str, int | torch.dtype]
    for w in weights:
        if isinstance(w, BlockedFp8):
            nbytes, kind = w.weight.numel(), ("fp8", w.k_block)
        elif w.dim() == 3:
            nbytes, kind = w.numel() * w.element_size(), ("float", w.dtype)
        else:
            return False
        if policy.form(rows, True, nbytes) != "kernel-rows":
            return False
        kinds.add(kind)
    return len(kinds) == 1


def _graph_form(
    x: torch.Tensor, weight: torch.Tensor | BlockedFp8, policy: ProjectionPolicy
) -> torch.Tensor:
    """x @ weight.T in one of the forms Inductor compiles; a blocked fp8 weight dequantized in
    the graph first (and that one's form picked by its dequantized size)."""
    if isinstance(weight, BlockedFp8):
        deq = dequantize_blocked(weight.weight, weight.scales, weight.k_block, x.dtype)
        return project(x, deq, policy)
    lead, in_features = x.shape[:-1], x.shape[-1]
    rows = x.numel() // in_features
    nbytes = weight.numel() * weight.element_size()
    form = policy.form(rows, weight.dim() == 3, nbytes)  # bundle.json records the forms
    if form.startswith("blocked"):
        nb, _, lanes = weight.shape
        x2 = x.reshape(rows, in_features)
        if form == "blocked-rows":
            # the rows in float32 once (bf16: no conversion per row and weight tile)
            xf = materialized(x2.float())
            # one reduction per row over the same tile: Inductor fuses them and loads each
            # weight vector once for every row; float32 accumulation, one cast per output
            per_row = [
                (xf[r][None, :, None] * weight.float()).sum(1).reshape(nb * lanes)
                for r in range(rows)
            ]
            out = torch.stack(per_row).to(x.dtype)
        else:
            out = torch.matmul(x2.unsqueeze(0), weight)  # [nb, rows, L]
            out = out.permute(1, 0, 2).reshape(rows, nb * lanes)
        return out.reshape(*lead, nb * lanes)
    if form == "reduction":
        return (x.unsqueeze(-2) * weight).sum(-1)
    return x @ weight.t()  # "mm", "dot"
