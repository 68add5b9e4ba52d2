"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum), read at their width: symmetric 4- or 8-bit
codes with a float16 scale per group of inputs, one `sym` QuantScheme (kernels/intquant.py).

Per linear module `<m>`, with the weight transposed ([in, out]) and packed along its inputs:

    <m>.qweight  int32 [in*bits/32, out]     word r holds inputs r*per .. r*per+per-1 (low first)
    <m>.qzeros   int32 [groups, out*bits/32] word c holds outputs c*per .. (low bits first)
    <m>.scales   f16   [groups, out]
    <m>.g_idx    int32 [in]                  each input's group

per = 32/bits; groups = in/group_size, or 1 where group_size is -1 (one group a row). The
value is (q - z[g]) * scale[g]. checkpoint_format "gptq" (v1) stores every zero point less one
(AutoGPTQ's `zeros -= 1` before packing), so z = stored + 1, as vLLM's and AutoGPTQ's kernels
read it; "gptq_v2" stores z as it is. A symmetric checkpoint's zero points are all 2^(bits-1)
(GPTQ's quantizer sets them so): anything else is refused by name, never read as another scheme.
Act-order (desc_act) checkpoints permute the groups through g_idx: neffkit reads groups in input
order only, so g_idx must be i // group_size, and is checked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from neffkit.checkpoints.formats.awq import (
    HINT,
    SCALE_DTYPES,
    check_orphans,
    expect_shape,
    tensor_header,
    unpack_words,
)
from neffkit.checkpoints.quantized import QuantEntry, QuantTensor
from neffkit.errors import ModelError
from neffkit.kernels.intquant import QuantScheme


def _checkpoint_format(quant_config: dict) -> str:
    """GPTQModel writes `checkpoint_format`; some exports name it `format`."""
    return str(quant_config.get("checkpoint_format") or quant_config.get("format") or "gptq")


class GptqFormat:
    """GPTQ checkpoints: 4- or 8-bit, symmetric, groups of 32/64/128 or -1 (per channel),
    desc_act false, checkpoint_format gptq or gptq_v2 (the config is checked by
    models/quantization.py `check_gptq`)."""

    def __init__(self, quant_config: dict) -> None:
        self.bits = int(quant_config["bits"])
        self.group = int(quant_config.get("group_size", 128))  # -1: the whole row
        self.zero_offset = 1 if _checkpoint_format(quant_config).lower() == "gptq" else 0
        zero = 1 << (self.bits - 1)
        self.scheme = QuantScheme("sym", self.bits, max(self.group, 0), zero=zero)

    def entries(self, headers: dict[str, dict]) -> dict[str, QuantEntry]:
        out: dict[str, QuantEntry] = {}
        per = 32 // self.bits
        modules = {n.removesuffix(".qweight") for n in headers if n.endswith(".qweight")}
        check_orphans(headers, modules, ("qzeros", "scales", "g_idx"))
        for m in sorted(modules):
            names: tuple[str, ...] = (f"{m}.qweight", f"{m}.qzeros", f"{m}.scales")
            words, cols = tensor_header(headers, names[0], ("I32",), 2)
            rows = words * per
            group = rows if self.group < 0 else self.group
            beside = f"beside {names[0]} {[words, cols]} ({rows} inputs, {cols} outputs)"
            if rows % group or cols % per:
                raise ModelError(
                    f"tensor {names[0]!r} {[words, cols]}: {rows} inputs in groups of {group} "
                    f"and {cols} outputs packed {per} a word do not divide",
                    HINT,
                )
            zeros = tensor_header(headers, names[1], ("I32",), 2)
            expect_shape(names[1], zeros, (rows // group, cols // per), beside)
            scales = tensor_header(headers, names[2], SCALE_DTYPES, 2)
            expect_shape(names[2], scales, (rows // group, cols), beside)
            if f"{m}.g_idx" in headers:
                g_idx = tensor_header(headers, f"{m}.g_idx", ("I32", "I64"), 1)
                expect_shape(f"{m}.g_idx", g_idx, (rows,), beside)
                names += (f"{m}.g_idx",)
            if f"{m}.weight" in headers:
                raise ModelError(f"module {m!r} has both a float weight and a qweight", HINT)
            out[f"{m}.weight"] = QuantEntry((cols, rows), self.scheme, names)
        return out

    def decode(
        self, name: str, entry: QuantEntry, read: Callable[[str], torch.Tensor]
    ) -> QuantTensor:
        qweight, qzeros, scales = (read(n) for n in entry.stored[:3])
        rows = entry.shape[-1]
        group = entry.scheme.group_of(rows)
        if len(entry.stored) > 3:
            _check_g_idx(entry.stored[3], read(entry.stored[3]), group)
        codes = unpack_words(qweight, self.bits, 0).t().to(torch.uint8).contiguous()
        zeros = unpack_words(qzeros, self.bits, -1) + self.zero_offset
        if bool((zeros != entry.scheme.zero).any()):
            found = sorted(set(zeros.unique().tolist()))[:8]
            raise ModelError(
                f"tensor {entry.stored[1]!r}: a symmetric {self.bits}-bit GPTQ checkpoint's "
                f"zero points are all {entry.scheme.zero}; these read {found}",
                hint="check quantization_config.sym and checkpoint_format (gptq stores zero "
                "points less one, gptq_v2 as they are); neffkit reads symmetric GPTQ only",
            )
        return QuantTensor(entry.scheme, codes, scales.float().t().contiguous())


def _check_g_idx(name: str, g_idx: torch.Tensor, group: int) -> None:
    """Groups in input order (g_idx[i] == i // group), else refused by name: an act-order
    checkpoint whose config says desc_act false would otherwise widen with the wrong scales."""
    want = torch.arange(g_idx.numel()) // group
    if not torch.equal(g_idx.long(), want):
        first = int((g_idx.long() != want).nonzero()[0, 0])
        got, due = int(g_idx[first]), int(want[first])
        raise ModelError(
            f"tensor {name!r}: input {first} is in group {got}, not {due}"
            f" (neffkit reads GPTQ groups in input order, g_idx[i] == i // {group}: act-order "
            "checkpoints are not supported)",
            hint="re-quantize with desc_act=False, or use an AWQ or compressed-tensors export",
        )
