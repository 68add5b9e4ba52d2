"""GPT-OSS's release layout: its MoE experts in mxfp4 (OCP MX fp4), kept at 4 bits.

The checkpoint stores each expert projection as `<name>_blocks` (uint8 [E, rows, cols/32, 16]:
32 e2m1 codes a group, two a byte, element 2i in the low nibble) and `<name>_scales` (uint8
e8m0 [E, rows, cols/32]: the group's scale is 2^(e - 127)); rows × cols is the nn.Linear
layout ([E, 2I, hidden] for `gate_up_proj`, [E, hidden, I] for `down_proj`). transformers'
`convert_moe_packed_tensors` widens them to FP4_VALUES[code] * 2^(e - 127) and transposes to
HF's float layout, `gate_up_proj` [E, hidden, 2I] and `down_proj` [E, I, hidden], which is what
GPT-OSS's sharding rules read. So the logical weight is that transpose, its groups along dim -2
(`QuantTensor.group_dim`); the rules transpose the experts back to [E, out, in], where the
groups run along the graph weight's last dim as every integer weight's do.

The scale is built from its bits (exact, 2^-127 a float32 subnormal); e = 255 (NaN in e8m0) is
refused naming the tensor. The biases and every other tensor are float, read as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from neffkit.checkpoints.quantized import QuantEntry, QuantTensor
from neffkit.errors import ModelError
from neffkit.kernels.intquant import QuantScheme

SCHEME = QuantScheme("e2m1", 4, 32)
GROUP, BYTES = 32, 16  # values per scale; bytes per group of 32 fp4 codes
BLOCKS, SCALES = "_blocks", "_scales"
# the projections GPT-OSS ships in mxfp4 (transformers' Mxfp4GptOssExperts)
PROJECTIONS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
NAN = 255  # the e8m0 code of NaN


def e8m0_scales(exponents: torch.Tensor) -> torch.Tensor:
    """float32 2^(e - 127) of uint8 e8m0 codes 0..254, exactly: for e >= 1 the float whose
    exponent field is e and mantissa 0; for e = 0 the subnormal 2^-127 (mantissa bit 22)."""
    e = exponents.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    return bits.view(torch.float32)


def unpack_fp4(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [..., groups, 16] → one code per element [..., groups * 32] (low nibble first)."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1)
    return codes.reshape(*blocks.shape[:-2], blocks.shape[-2] * GROUP)


class Mxfp4Format:
    """`checkpoints.quantized.Format` of GPT-OSS's mxfp4 experts (module docstring); the
    config's options are checked by models/quantization.py (`check_mxfp4`)."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options

    def entries(self, headers: dict[str, dict]) -> dict[str, QuantEntry]:
        out: dict[str, QuantEntry] = {}
        for name in sorted(n for n in headers if n.endswith(BLOCKS)):
            base = name.removesuffix(BLOCKS)
            out[base] = _entry(base, headers)
        if not out:
            raise ModelError(
                "the checkpoint's quantization_config says mxfp4, but it holds no "
                "`*_blocks` / `*_scales` tensors",
                hint="a dequantized checkpoint: remove quantization_config from config.json",
            )
        return out

    def decode(
        self, name: str, entry: QuantEntry, read: Callable[[str], torch.Tensor]
    ) -> QuantTensor:
        blocks_name, scales_name = entry.stored
        blocks, exponents = read(blocks_name), read(scales_name)
        if bool((exponents == NAN).any()):
            where = [int(i) for i in (exponents == NAN).nonzero()[0]]
            raise ModelError(
                f"tensor {scales_name!r}: e8m0 scale 255 (NaN) at {where}; a NaN scale widens "
                "its whole group to NaN",
                hint="the checkpoint is damaged: download it again",
            )
        codes = unpack_fp4(blocks)  # [E, rows, cols]
        scale = e8m0_scales(exponents)  # [E, rows, cols / 32]
        return QuantTensor(SCHEME, codes.mT, scale.mT, group_dim=-2)


def _entry(base: str, headers: dict[str, dict]) -> QuantEntry:
    """The logical weight `base` ([E, cols, rows], HF's float layout) of its blocks and
    scales, refused by name where the two do not fit."""
    blocks, scales = base + BLOCKS, base + SCALES
    if not base.endswith(PROJECTIONS):
        raise ModelError(
            f"tensor {blocks!r}: neffkit reads mxfp4 for GPT-OSS's expert projections "
            f"({', '.join('*' + p for p in PROJECTIONS)}) only"
        )
    if scales not in headers:
        raise ModelError(f"tensor {blocks!r} has no scales {scales!r}")
    if base in headers:
        raise ModelError(f"tensor {base!r} is stored both as a float tensor and in mxfp4")
    for name in (blocks, scales):
        if headers[name]["dtype"] != "U8":
            raise ModelError(
                f"tensor {name!r} is {headers[name]['dtype']}; mxfp4 blocks and scales are U8"
            )
    b_shape, s_shape = tuple(headers[blocks]["shape"]), tuple(headers[scales]["shape"])
    if len(b_shape) != 4 or b_shape[-1] != BYTES or b_shape[:-1] != s_shape:
        raise ModelError(
            f"tensor {blocks!r} {list(b_shape)} and its scales {list(s_shape)}: mxfp4 expects "
            f"blocks [experts, rows, groups, {BYTES}] and scales [experts, rows, groups]"
        )
    experts, rows, groups, _ = b_shape
    return QuantEntry((experts, groups * GROUP, rows), SCHEME, (blocks, scales))
