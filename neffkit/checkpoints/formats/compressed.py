"""compressed-tensors integer checkpoints (llm-compressor's W4A16, W8A16 and W8A8), read at
their width as one QuantScheme per weight (kernels/intquant.py).

format pack-quantized (weight-only, 4 or 8 bits), per quantized module `<m>`:

    <m>.weight_packed      int32 [out, in*bits/32]   the codes q + 2^(bits-1), 32/bits a word
    <m>.weight_scale       float [out, in/group]     ([out, 1] for strategy channel)
    <m>.weight_shape       int64 [2]                 [out, in]
    <m>.weight_zero_point  int32 [out*bits/32, in/group]  asymmetric only: packed along out
    <m>.weight_g_idx       int32 [in]                activation order: read only if trivial

compressed-tensors' `pack_to_int32` stores element i of a row at bits i*bits of its bit stream
(no element straddles a word at 4 or 8 bits), offset to unsigned by 2^(bits-1), and the zero
points the same way down each column. Its `dequantize` computes (q - zp) * scale in the scale's
dtype; the codes here are those unsigned fields as they are, so symmetric weights are kind `sym`
with zero 2^(bits-1) and asymmetric ones kind `zero` with the stored zero-point fields: the
float32 values equal the library's exactly, and rounded to the scale's dtype, its own result.

format int-quantized (W8A8): `<m>.weight` int8 [out, in] and `<m>.weight_scale` [out, 1],
symmetric, with activations quantized per token at run time (intquant.project_w8a8): kind `sym`,
8 bits, zero 128 (code q + 128), activations "int8-token". That path runs where a projection
reads the weight; embeddings, MoE experts and DeepSeek's absorbed kv_b_proj are read otherwise,
so a W8A8 scheme reaching one of them is refused by name.

Which modules are quantized is what the checkpoint stores (a module with its `weight_scale`);
the config's groups say how: a module takes the group whose targets name it (exactly or by a
`re:` pattern), else the group whose targets are a module class ("Linear"). A stored module
the config ignores, or no group targets, is refused by name; modules not quantized (the
`ignore` list: lm_head, routers) are float tensors and pass as they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from neffkit.checkpoints.formats.awq import (
    HINT,
    SCALE_DTYPES,
    expect_shape,
    tensor_header,
    unpack_words,
)
from neffkit.checkpoints.quantized import QuantEntry, QuantTensor
from neffkit.errors import ModelError
from neffkit.kernels.intquant import QuantScheme

PACKED, INT = "pack-quantized", "int-quantized"
PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
# weights a graph reads other than through `project` (W8A8 quantizes a projection's rows)
NOT_PROJECTED = re.compile(
    r"(^|\.)(embed_tokens|wte|wpe|word_embeddings)$|\.experts(\.|$)|kv_b_proj$"
)


@dataclass(frozen=True)
class Group:
    """One config group: the modules it targets and the scheme their weights take."""

    name: str
    targets: tuple[str, ...]
    scheme: QuantScheme
    symmetric: bool

    def names(self, module: str) -> bool:
        """Whether a target names the module (exactly or by a `re:` pattern)."""
        return any(_names(t, module) for t in self.targets)

    @property
    def by_class(self) -> bool:
        """Whether a target is a module class ("Linear": capitalised, no dot, no pattern)."""
        return any(t[:1].isupper() and "." not in t for t in self.targets)


def _names(target: str, module: str) -> bool:
    """compressed-tensors' `match_name`: `re:` patterns by re.match, else the exact name."""
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), module) is not None
    return target == module


def _group(name: str, body: dict, fmt: str) -> Group:
    w = body.get("weights") or {}
    bits, symmetric = int(w["num_bits"]), bool(w.get("symmetric", True))
    group = int(w["group_size"]) if w.get("strategy") == "group" else 0
    if fmt == INT:
        scheme = QuantScheme("sym", 8, 0, zero=128, activations="int8-token")
    elif symmetric:
        scheme = QuantScheme("sym", bits, group, zero=1 << (bits - 1))
    else:
        scheme = QuantScheme("zero", bits, group)
    return Group(name, tuple(body.get("targets") or ()), scheme, symmetric)


class CompressedTensorsFormat:
    """compressed-tensors pack-quantized and int-quantized checkpoints (the config is checked
    by models/quantization.py `check_compressed_int`)."""

    def __init__(self, quant_config: dict) -> None:
        self.format = str(quant_config["format"])
        self.ignore = tuple(quant_config.get("ignore") or ())
        groups = quant_config.get("config_groups") or {}
        self.groups = [_group(n, b or {}, self.format) for n, b in groups.items()]

    def group_of(self, module: str) -> Group:
        """The config group a stored module's weight is quantized by (module docstring)."""
        where = "quantization_config"
        if any(_names(t, module) for t in self.ignore):
            raise ModelError(
                f"module {module!r} is stored quantized but {where}.ignore lists it", HINT
            )
        found = [g for g in self.groups if g.names(module)] or [
            g for g in self.groups if g.by_class
        ]
        schemes = {g.scheme for g in found}
        if not found or len(schemes) > 1:
            which = ", ".join(g.name for g in found) or "none"
            raise ModelError(
                f"module {module!r} is stored quantized and {len(schemes)} weight schemes of "
                f"{where}.config_groups target it ({which}); neffkit reads exactly one",
                HINT,
            )
        return found[0]

    def entries(self, headers: dict[str, dict]) -> dict[str, QuantEntry]:
        out: dict[str, QuantEntry] = {}
        modules = {n.removesuffix(".weight_scale") for n in headers if n.endswith(".weight_scale")}
        for n in headers:  # a part without its module's scale: the weight would be lost
            module, _, part = n.rpartition(".")
            if part in PARTS and module not in modules:
                raise ModelError(
                    f"tensor {n!r} has no {module + '.weight_scale'!r} beside it", HINT
                )
        for m in sorted(modules):
            group = self.group_of(m)
            if self.format == INT:
                out[f"{m}.weight"] = self._int_entry(headers, m, group)
            else:
                out[f"{m}.weight"] = self._packed_entry(headers, m, group)
        return out

    def _int_entry(self, headers: dict[str, dict], m: str, group: Group) -> QuantEntry:
        if NOT_PROJECTED.search(m):
            raise ModelError(
                f"module {m!r}: W8A8 (int8 activations per token) runs where a projection reads "
                "the weight, and neffkit reads this one otherwise (an embedding, MoE experts, "
                "an absorbed attention weight)",
                hint="re-export with the module in the recipe's ignore list, or use a "
                "weight-only scheme (W8A16, W4A16) for it",
            )
        for part in ("weight_packed", "weight_zero_point", "weight_g_idx"):
            if f"{m}.{part}" in headers:
                raise ModelError(
                    f"tensor {f'{m}.{part}'!r}: format int-quantized stores symmetric int8 "
                    "weights as they are (no packing, zero points or activation order)",
                    HINT,
                )
        weight = tensor_header(headers, f"{m}.weight", ("I8",), 2)
        scale = tensor_header(headers, f"{m}.weight_scale", SCALE_DTYPES, 2)
        expect_shape(f"{m}.weight_scale", scale, (weight[0], 1), f"beside {m}.weight {weight}")
        return QuantEntry(weight, group.scheme, (f"{m}.weight", f"{m}.weight_scale"))

    def _packed_entry(self, headers: dict[str, dict], m: str, group: Group) -> QuantEntry:
        scheme, bits = group.scheme, group.scheme.bits
        names: tuple[str, ...] = (f"{m}.weight_packed", f"{m}.weight_scale", f"{m}.weight_shape")
        rows, words = tensor_header(headers, names[0], ("I32",), 2)
        tensor_header(headers, names[2], ("I64", "I32"), 1)
        scale = tensor_header(headers, names[1], SCALE_DTYPES, 2)
        beside = f"beside {names[0]} {[rows, words]}"
        # the inputs: the groups' (exact), else as many as the words hold (weight_shape says)
        cols = scale[1] * scheme.group if scheme.group else words * 32 // bits
        if -(-cols * bits // 32) != words:
            raise ModelError(
                f"tensor {names[0]!r} {[rows, words]}: {words} words of {bits}-bit codes do "
                f"not hold the {cols} inputs its scales {list(scale)} imply at group size "
                f"{scheme.group}",
                HINT,
            )
        expect_shape(names[1], scale, (rows, cols // scheme.group_of(cols)), beside)
        if f"{m}.weight" in headers:
            raise ModelError(f"module {m!r} has both a float weight and a weight_packed", HINT)
        zero = f"{m}.weight_zero_point"
        if group.symmetric == (zero in headers):
            state = "without" if zero not in headers else "with"
            raise ModelError(
                f"module {m!r}: {'a symmetric' if group.symmetric else 'an asymmetric'} scheme "
                f"(config group {group.name}) {state} its weight_zero_point",
                HINT,
            )
        if zero in headers:
            zeros = tensor_header(headers, zero, ("I32",), 2)
            expect_shape(zero, zeros, (-(-rows * bits // 32), scale[1]), beside)
            names += (zero,)
        if f"{m}.weight_g_idx" in headers:
            g_idx = tensor_header(headers, f"{m}.weight_g_idx", ("I32", "I64"), 1)
            expect_shape(f"{m}.weight_g_idx", g_idx, (cols,), beside)
            names += (f"{m}.weight_g_idx",)
        return QuantEntry((rows, cols), scheme, names)

    def decode(
        self, name: str, entry: QuantEntry, read: Callable[[str], torch.Tensor]
    ) -> QuantTensor:
        scale = read(entry.stored[1]).float()
        if self.format == INT:
            q = read(entry.stored[0])
            return QuantTensor(entry.scheme, (q.to(torch.int16) + 128).to(torch.uint8), scale)
        packed, stored_shape = read(entry.stored[0]), read(entry.stored[2])
        rows, cols = entry.shape
        if stored_shape.tolist() != [rows, cols]:
            raise ModelError(
                f"tensor {entry.stored[2]!r} says {stored_shape.tolist()}; its packed codes and "
                f"scales hold [{rows}, {cols}] (neffkit reads weights whose inputs fill whole "
                f"words of {32 // entry.scheme.bits} codes)",
                HINT,
            )
        bits, aux = entry.scheme.bits, None
        codes = unpack_words(packed, bits, -1)[:, :cols].to(torch.uint8).contiguous()
        for part in entry.stored[3:]:
            if part.endswith("_zero_point"):  # packed down each column
                aux = unpack_words(read(part), bits, 0)[:rows].float().contiguous()
            else:
                _check_g_idx(part, read(part), entry.scheme.group_of(cols))
        return QuantTensor(entry.scheme, codes, scale, aux)


def _check_g_idx(name: str, g_idx: torch.Tensor, group: int) -> None:
    """Groups in input order (g_idx[i] == i // group), else refused by name: activation-order
    groups would widen each input with another group's scale."""
    want = torch.arange(g_idx.numel()) // group
    if not torch.equal(g_idx.long(), want):
        first = int((g_idx.long() != want).nonzero()[0, 0])
        raise ModelError(
            f"tensor {name!r}: input {first} is in group {int(g_idx[first])}, not "
            f"{int(want[first])} (neffkit reads groups in input order; activation-order groups "
            "are not supported)",
            hint="re-quantize with actorder 'static' or 'weight' (llm-compressor's GPTQModifier)",
        )
