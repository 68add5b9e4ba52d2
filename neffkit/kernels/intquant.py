"""Integer and fp4 weights kept at their storage width: the one layout every quantized format is
read into, and its dequantization inside the graph, next to the matmul that reads it.

Every format neffkit reads (GGUF's Q4_0 ... Q6_K, AWQ, GPTQ, compressed-tensors int, GPT-OSS's
mxfp4, the manifest's own int8/int4) is one `QuantScheme` over an [..., out, in] weight: an
unsigned code per element (`bits` wide) and, per group of `group` consecutive inputs of a row,
a float32 scale and (by `kind`) a zero point or an additive minimum:

    sym   (code - zero) * scale          zero a constant (Q4_0: 8, Q6_K: 32, int8: 128)
    zero  (code - zero[g]) * scale       zero per group (AWQ, GPTQ, asymmetric compressed-tensors)
    min   code * scale + min[g]          GGUF's *_1 and K-quants (`d * q - dmin * m`)
    e2m1  FP4_VALUES[code] * scale       mxfp4: scale 2^(e - 127)

Each is written in the order and float32 rounding of the library that defines the format
(gguf-py's `dequantize`, compressed-tensors, transformers' mxfp4 conversion), so the widened
values are exactly the float twin's: GGUF K-quants' two-level scales are multiplied out into one
float32 per group at build time (`d * sc`: exact), not in the graph.

The bundle stores the codes packed (`pack_codes`): 8-bit one a byte; 4-bit two a byte (element
2i in the low nibble); 5- and 6-bit as a nibble plane plus a plane of the high bits
(`<weight>.qhigh`), so Q6_K costs 6 bits a weight, not 8. Scales are `<weight>.qscale`, zero
points `<weight>.qzero`, minimums `<weight>.qmin` (float32 [..., out, in/group]). `group` 0 is
one group a row (per output channel).

Activations stay in the model dtype (weight-only), except `activations="int8-token"` (W8A8):
each token's row is quantized to int8 with its own scale (absmax / 127, round half to even, as
vLLM's dynamic per-token scheme) and the integer dot products are scaled by both scales: in the
graph (`project_w8a8`), or on CPU builds with neffkit's kernels in int32 (`project_w8a8_kernel`).
`activations="int8-block"` (the manifest's opt-in for integer checkpoints) quantizes the rows per
block of 32 inputs, llama.cpp's arithmetic (kernels/int8_blocks.py); the weight stays a
`PackedWeight`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

KINDS = ("sym", "zero", "min", "e2m1")
# e2m1 (OCP MX fp4): sign, 2 exponent bits, 1 mantissa bit, by code
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
SCALE, ZERO, MIN, HIGH = ".qscale", ".qzero", ".qmin", ".qhigh"
AUX_SUFFIXES = (SCALE, ZERO, MIN, HIGH)
ACTIVATIONS = ("", "int8-token", "int8-block")


@dataclass(frozen=True)
class QuantScheme:
    """How one weight's codes become values (module docstring); recorded per graph weight as
    `to_id()` in bundle.json, so a graph is traced from it and inspect shows it."""

    kind: str
    bits: int
    group: int  # inputs per scale along a row; 0: the whole row
    zero: int = 0  # kind "sym": the code of 0.0
    activations: str = ""  # "int8-token": W8A8; "int8-block": kernels/int8_blocks.py

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"quantization kind {self.kind!r}: expected one of {KINDS}")
        if self.bits not in (4, 5, 6, 8) or (self.kind == "e2m1" and self.bits != 4):
            raise ValueError(f"{self.kind}: {self.bits}-bit codes are not a layout neffkit reads")
        if self.group < 0 or self.activations not in ACTIVATIONS:
            raise ValueError(f"group {self.group}, activations {self.activations!r}")

    def to_id(self) -> str:
        parts = [self.kind, f"b{self.bits}", f"g{self.group}"]
        if self.kind == "sym":
            parts.append(f"z{self.zero}")
        if self.activations:
            parts.append(f"a:{self.activations}")
        return ":".join(parts)

    @classmethod
    def from_id(cls, text: str) -> QuantScheme:
        head, _, act = text.partition(":a:")
        kind, *rest = head.split(":")
        fields = {{"b": "bits", "g": "group", "z": "zero"}[p[0]]: int(p[1:]) for p in rest}
        return cls(kind, activations=act, **fields)

    @property
    def aux(self) -> str:
        """The per-group tensor beside the scales: ZERO, MIN or "" (none)."""
        return {"zero": ZERO, "min": MIN}.get(self.kind, "")

    def group_of(self, in_features: int) -> int:
        return self.group or in_features

    def stored(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """suffix ("" for the codes) → (shape, dtype) of what the bundle stores for a weight of
        logical `shape` [..., out, in]."""
        *lead, rows, cols = shape
        groups = cols // self.group_of(cols)
        out = {"": ((*lead, rows, cols * min(self.bits, 4) // 8 if self.bits < 8 else cols), U8)}
        if self.bits in (5, 6):
            out[HIGH] = ((*lead, rows, cols * (self.bits - 4) // 8), U8)
        out[SCALE] = ((*lead, rows, groups), torch.float32)
        if self.aux:
            out[self.aux] = ((*lead, rows, groups), torch.float32)
        return out

    def check_shape(self, shape: tuple[int, ...]) -> str | None:
        """Why a weight of `shape` cannot take this layout (None: it can)."""
        cols = shape[-1]
        per_byte = {4: 2, 5: 8, 6: 4, 8: 1}[self.bits]
        if cols % per_byte:
            return f"{cols} inputs do not pack {per_byte} to a byte at {self.bits} bits"
        if cols % self.group_of(cols):
            return f"{cols} inputs are not a whole number of groups of {self.group}"
        return None


U8 = torch.uint8


def pack_codes(codes: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """uint8 codes, one per element [..., in] → what the bundle stores (suffix → tensor)."""
    c = codes.to(U8)
    if bits == 8:
        return {"": c.contiguous()}
    low = c & 0x0F
    out = {"": (low[..., 0::2] | (low[..., 1::2] << 4)).contiguous()}
    if bits > 4:
        high = (c >> 4).reshape(*c.shape[:-1], -1, 8 // (bits - 4))
        shifts = torch.arange(high.shape[-1], dtype=U8) * (bits - 4)
        out[HIGH] = (high << shifts).sum(-1, dtype=torch.int32).to(U8).contiguous()
    return out


def unpack_codes(packed: torch.Tensor, high: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The codes one per element again (uint8 [..., in]); graph-safe (shifts and masks)."""
    if bits == 8:
        return packed
    low = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    if high is None:
        return low
    per_byte = 8 // (bits - 4)
    shifts = torch.arange(per_byte, dtype=U8, device=packed.device) * (bits - 4)
    hi = (high.unsqueeze(-1) >> shifts) & ((1 << (bits - 4)) - 1)
    return low | (hi.flatten(-2) << 4)


def fp4_values(codes: torch.Tensor) -> torch.Tensor:
    """FP4_VALUES[code] as float32, computed, not looked up: exact, pointwise (it fuses), and
    lowerable for neuron (a table is a tensor constant, lifted out of the graph, which that
    target refuses, and a gather per weight element there is a DMA each)."""
    c = codes.float()
    negative = c >= 8
    m = torch.where(negative, c - 8, c)  # magnitude code: 0 0.5 1 1.5 2 3 4 6
    mag = torch.where(m < 4, m * 0.5, torch.where(m < 6, m - 2, m * 2 - 8))
    return torch.where(negative, -mag, mag)  # code 8: -0.0


def dequantize(
    parts: dict[str, torch.Tensor], scheme: QuantScheme, dtype: torch.dtype
) -> torch.Tensor:
    """The weight's values [..., out, in] in `dtype` from its stored parts (suffix → tensor),
    in float32 first and in the defining library's order (module docstring). Pointwise over
    the codes, so Inductor fuses it into the reduction that reads the weight."""
    codes = unpack_codes(parts[""], parts.get(HIGH), scheme.bits)
    group = scheme.group_of(codes.shape[-1])
    return _values(codes, parts, scheme, group).to(dtype)


def _values(
    codes: torch.Tensor, parts: dict[str, torch.Tensor], scheme: QuantScheme, repeats: int
) -> torch.Tensor:
    """float32 values of `codes` [..., out, n] by the scheme's formula, each per-group part
    repeated `repeats` times along the row (the codes of one group lie side by side)."""

    def per_element(t: torch.Tensor) -> torch.Tensor:
        return t.float().repeat_interleave(repeats, dim=-1)

    scale = per_element(parts[SCALE])
    if scheme.kind == "e2m1":
        return fp4_values(codes) * scale
    if scheme.kind == "min":
        return codes.float() * scale + per_element(parts[MIN])
    if scheme.kind == "zero":
        return (codes.float() - per_element(parts[ZERO])) * scale
    return (codes.float() - scheme.zero) * scale


def nibble_halves(
    parts: dict[str, torch.Tensor], scheme: QuantScheme, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A 4-bit weight's values as two [..., out, in/2] halves, the even inputs' (low nibbles)
    and the odd inputs' (high nibbles), each value exactly `dequantize`'s: a reduction over
    the halves reads every packed byte once, contiguously, where the interleaved [out, in]
    form makes Inductor unpack the bytes into a buffer first (a `cat`) or index them per
    element (no vector loop). None where a byte's two codes may fall in different groups (an
    odd group) or codes have a high plane (5, 6 bits). The nibbles are taken in int32: AVX-512
    has no byte shifts (ATen emulates them with shuffles)."""
    group = scheme.group_of(parts[""].shape[-1] * 2)
    if scheme.bits != 4 or group % 2:
        return None
    codes = parts[""].to(torch.int32)
    low = _values(codes & 0x0F, parts, scheme, group // 2).to(dtype)
    high = _values(codes >> 4, parts, scheme, group // 2).to(dtype)
    return low, high


def kernel_table(scheme: QuantScheme, device: torch.device) -> tuple[torch.Tensor, int]:
    """A 4- or 8-bit scheme as neffkit::packed_rows reads it (csrc/packed_rows.cpp): the 16 or
    256 float32 values `base[code]` its formula starts from, and the mode that applies a
    group's parts (0: base * scale; 1: (base - zero) * scale; 2: base * scale + min), each step
    rounded as `_values` rounds it. Computed in the graph (no tensor constant)."""
    codes = torch.arange(1 << scheme.bits, dtype=torch.float32, device=device)
    if scheme.kind == "e2m1":
        return fp4_values(codes), 0
    if scheme.kind == "zero":
        return codes, 1
    if scheme.kind == "min":
        return codes, 2
    return codes - scheme.zero, 0


def integer_values(parts: dict[str, torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    """A symmetric scheme's signed integer values as float32 (W8A8's weight side)."""
    codes = unpack_codes(parts[""], parts.get(HIGH), scheme.bits)
    return codes.float() - scheme.zero


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token int8 (W8A8's activation side): (integer values as float32, scale
    [..., 1]); scale absmax / 127 (1 for an all-zero row), values x * (127 / absmax) rounded
    half to even: vLLM's `dynamic_scaled_int8_quant` multiplies by that reciprocal rather than
    dividing by the scale, which rounds differently now and then."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    # a true division: `127.0 / amax` is torch's reciprocal(amax) * 127, rounded twice
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(xf * inverse).clamp(-127, 127), scale


@dataclass(frozen=True)
class Int8Activations:
    """A W8A8 projection weight in the graph: `project` quantizes the rows it multiplies."""

    parts: dict[str, torch.Tensor]
    scheme: QuantScheme

    @property
    def out_features(self) -> int:
        return int(self.parts[""].shape[-2])


def project_w8a8(x: torch.Tensor, weight: Int8Activations) -> torch.Tensor:
    """x @ W.T with x quantized per token: integer dot products (exact in float32 while
    127 * 127 * in < 2^24; beyond that rounded as any float32 sum), scaled as vLLM's
    cutlass_scaled_mm epilogue does: x_scale * (w_scale * acc), in float32."""
    xq, x_scale = quantize_tokens(x)
    wq = integer_values(weight.parts, weight.scheme)
    acc = xq @ wq.transpose(-1, -2)
    w_scale = weight.parts[SCALE].float().reshape(-1)  # per output channel
    return (x_scale * (w_scale * acc)).to(x.dtype)


# neffkit::int8_rows sums code * x in int32: 255 * 127 * in < 2^31
INT8_KERNEL_MAX_IN = 66000


def int8_kernel_reads(weight: Int8Activations) -> bool:
    """Does neffkit::int8_rows (csrc/int8_rows.cpp) read this weight: 8-bit codes q + 128
    [out, in] with one scale a row (compressed-tensors' W8A8), in at most 66000 inputs?"""
    scheme, codes = weight.scheme, weight.parts[""]
    layout = scheme.kind == "sym" and scheme.bits == 8 and scheme.zero == 128 and not scheme.group
    return layout and codes.dim() == 2 and codes.shape[-1] <= INT8_KERNEL_MAX_IN


def project_w8a8_kernel(x: torch.Tensor, weights: Sequence[Int8Activations]) -> list[torch.Tensor]:
    """`project_w8a8` for each weight reading x, in one neffkit::int8_rows call: the same
    quantization of the rows and the same epilogue, the integer dot products summed in int32
    (exact for any `in`), so bit for bit `project_w8a8`'s wherever its float32 sums are exact."""
    lead, in_features = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, in_features)
    x2 = x2 if x2.dtype in (torch.float32, torch.bfloat16) else x2.float()  # exact widening
    codes, scales = [w.parts[""] for w in weights], [w.parts[SCALE] for w in weights]
    out = torch.ops.neffkit.int8_rows(x2, codes, scales)  # float32 [rows, sum of out]
    parts = out.split([w.out_features for w in weights], dim=-1)
    return [part.to(x.dtype).reshape(*lead, part.shape[-1]) for part in parts]


@dataclass(frozen=True)
class PackedWeight:
    """A weight-only integer / fp4 projection weight in the graph, still its stored parts:
    `project` picks the form that reads it (models/projection.py, `ProjectionPolicy.
    packed_form`), `widened()` is its values as `dequantize` gives them."""

    parts: dict[str, torch.Tensor]
    scheme: QuantScheme
    dtype: torch.dtype  # of the values: the model's compute dtype

    @property
    def out_features(self) -> int:
        return int(self.parts[""].shape[-2])

    def widened(self) -> torch.Tensor:
        return dequantize(self.parts, self.scheme, self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` widened [*ids.shape, in] (an embedding lookup): the parts gathered
        first, so a step widens the rows it reads, not the table."""
        return dequantize({k: v[ids] for k, v in self.parts.items()}, self.scheme, self.dtype)


def graph_weights(
    w: dict[str, torch.Tensor],
    schemes: dict[str, QuantScheme],
    dtype: torch.dtype,
    packed: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor | Int8Activations | PackedWeight]:
    """A graph's weights with each quantized one's parts joined: kept as `PackedWeight` where
    `packed(name)` (weights that reach the graph only through `project`, which reads the codes
    in place), else widened right here for the weight-only schemes (the widening is pointwise,
    so it fuses into whatever reads it); kept as `Int8Activations` for W8A8 (projections
    quantize their rows). "int8-block" is set on projection weights only (`project` reads
    it)."""
    out: dict[str, torch.Tensor | Int8Activations | PackedWeight] = {}
    for name, tensor in w.items():
        if name.endswith(AUX_SUFFIXES) and name.rsplit(".q", 1)[0] in schemes:
            continue
        scheme = schemes.get(name)
        if scheme is None:
            out[name] = tensor
            continue
        parts = {"": tensor, **{s: w[name + s] for s in AUX_SUFFIXES if name + s in w}}
        if scheme.activations == "int8-token":
            out[name] = Int8Activations(parts, scheme)
        elif packed is not None and packed(name):
            # NKI seam: on neuron `project` widens it and writes a `dot` (both in HLO); a fused
            # NKI dequant-matmul kernel would be a form of ProjectionPolicy.packed_form there
            out[name] = PackedWeight(parts, scheme, dtype)
        else:
            out[name] = dequantize(parts, scheme, dtype)
    return out
