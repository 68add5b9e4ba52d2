"""AutoAWQ's GEMM layout, read at its width: 4-bit codes with a zero point and a float16 scale
per group of inputs, one `zero` QuantScheme (kernels/intquant.py).

Per linear module `<m>` the checkpoint holds, with the weight TRANSPOSED ([in, out], the
layout AWQ's GEMM kernel reads):

    <m>.qweight  int32 [in, out/8]         eight 4-bit codes a word
    <m>.qzeros   int32 [in/group, out/8]   eight 4-bit zero points a word
    <m>.scales   f16   [in/group, out]

Within a word, nibble i (bits 4i..4i+3) holds output column 8c + AWQ_ORDER[i] (AutoAWQ's
`WQLinear_GEMM.from_linear`, undone by `reverse_awq_order` in awq/utils/packing_utils.py). The
value is (q - z) * scale, the order of AutoAWQ's `dequantize_gemm`, here in float32 (a float16
scale widens exactly). The logical weight is `<m>.weight` [out, in], nn.Linear's layout; a bias
is an ordinary tensor and passes through as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from neffkit.checkpoints.quantized import QuantEntry, QuantTensor
from neffkit.errors import ModelError
from neffkit.kernels.intquant import QuantScheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word → column 8c + AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j ← nibble AWQ_REVERSE_ORDER[j]
SCALE_DTYPES = ("F16", "BF16", "F32")  # each widens to float32 exactly
HINT = "the checkpoint's tensors do not fit its quantization_config; re-export it"


def tensor_header(
    headers: dict[str, dict], name: str, dtypes: tuple[str, ...], rank: int
) -> tuple[int, ...]:
    """The shape of stored tensor `name`, refused by name if missing, of another dtype or of
    another rank than the format stores."""
    if name not in headers:
        raise ModelError(f"tensor {name!r} is missing (its weight's other parts are there)", HINT)
    dtype, shape = headers[name]["dtype"], tuple(headers[name]["shape"])
    if dtype not in dtypes or len(shape) != rank:
        raise ModelError(
            f"tensor {name!r} is {dtype} {list(shape)}; the format stores it as "
            f"{' or '.join(dtypes)} with {rank} dimensions",
            HINT,
        )
    return shape


def expect_shape(name: str, shape: tuple[int, ...], want: tuple[int, ...], why: str) -> None:
    """Refuse a stored tensor whose shape does not fit its weight (a ModelError naming it)."""
    if shape != want:
        raise ModelError(
            f"tensor {name!r} has shape {list(shape)}; {why} it must be {list(want)}", HINT
        )


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words → their 32/bits fields, low bits first, spread along `dim` (int32 values in
    [0, 2^bits)): a word at index k along `dim` becomes indices k*per .. k*per + per - 1."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    dim = dim % words.dim()
    view = [1] * (words.dim() + 1)
    view[dim + 1] = per
    fields = (words.unsqueeze(dim + 1) >> shifts.view(view)) & ((1 << bits) - 1)
    return fields.flatten(dim, dim + 1)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [rows, cols/8] → the 4-bit values [rows, cols] in column order."""
    fields = unpack_words(words, 4, -1).unflatten(-1, (-1, 8))
    return fields[..., list(AWQ_REVERSE_ORDER)].flatten(-2)


def check_orphans(headers: dict[str, dict], found: set[str], parts: tuple[str, ...]) -> None:
    """A zero-point or scale tensor whose module has no `qweight` is refused by name: its
    weight would otherwise be missing, or read as some other tensor."""
    for name in headers:
        module, _, part = name.rpartition(".")
        if part in parts and module not in found:
            raise ModelError(f"tensor {name!r} has no {module + '.qweight'!r} beside it", HINT)


class AwqFormat:
    """AutoAWQ GEMM checkpoints (4-bit, zero points, groups of 32/64/128; the config is checked
    by models/quantization.py `check_awq`)."""

    def __init__(self, quant_config: dict) -> None:
        self.group = int(quant_config["group_size"])
        self.scheme = QuantScheme("zero", 4, self.group)

    def entries(self, headers: dict[str, dict]) -> dict[str, QuantEntry]:
        out: dict[str, QuantEntry] = {}
        modules = {n.removesuffix(".qweight") for n in headers if n.endswith(".qweight")}
        check_orphans(headers, modules, ("qzeros", "scales"))
        for m in sorted(modules):
            names = (f"{m}.qweight", f"{m}.qzeros", f"{m}.scales")
            rows, words = tensor_header(headers, names[0], ("I32",), 2)
            cols = words * 8
            if rows % self.group:
                raise ModelError(
                    f"tensor {names[0]!r} {[rows, words]}: its {rows} inputs are not a whole "
                    f"number of groups of {self.group} (quantization_config.group_size)",
                    HINT,
                )
            groups = rows // self.group
            zeros = tensor_header(headers, names[1], ("I32",), 2)
            expect_shape(names[1], zeros, (groups, words), f"beside {names[0]} {[rows, words]}")
            scales = tensor_header(headers, names[2], SCALE_DTYPES, 2)
            expect_shape(names[2], scales, (groups, cols), f"beside {names[0]} {[rows, words]}")
            if f"{m}.weight" in headers:
                raise ModelError(f"module {m!r} has both a float weight and a qweight", HINT)
            out[f"{m}.weight"] = QuantEntry((cols, rows), self.scheme, names)
        return out

    def decode(
        self, name: str, entry: QuantEntry, read: Callable[[str], torch.Tensor]
    ) -> QuantTensor:
        qweight, qzeros, scales = (read(n) for n in entry.stored)
        codes = unpack_awq(qweight).t().to(torch.uint8).contiguous()  # [out, in]
        zeros = unpack_awq(qzeros).t().float().contiguous()  # [out, groups]
        return QuantTensor(entry.scheme, codes, scales.float().t().contiguous(), zeros)
