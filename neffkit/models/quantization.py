"""fp8 checkpoints: which quantization_config layouts neffkit reads, and every other one refused.

Pure Python (no torch): the manifest reads the config before any weight.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neffkit.errors import ModelError

# fp8 scale layouts as [block_out, block_in]; 0 spans the whole dimension
PER_TENSOR, PER_CHANNEL = (0, 0), (1, 0)
CT_STRATEGIES = {"tensor": PER_TENSOR, "channel": PER_CHANNEL}


def fp8_scheme(cfg: dict[str, Any], path: Path) -> tuple[tuple[int, ...], str]:
    """(fp8 scale block, the checkpoint's scale-tensor suffix) of an fp8 checkpoint; ((), "")
    when unquantized. Weight-only: activations stay in the model dtype (W8A16).

    Read: DeepSeek's fine-grained fp8 (quant_method fp8, `weight_scale_inv` per block),
    compressed-tensors float-quantized fp8 (`weight_scale` per tensor, channel or block) and
    FBGEMM fp8 (`weight_scale` per output channel). Every other method is refused by name:
    widening quantized tensors without their scales builds a bundle that generates garbage."""
    quant = cfg.get("quantization_config")
    if not quant:
        return (), ""
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
    where = f"{path}: quantization_config"
    if method == "mxfp4":
        raise ModelError(
            f"{path}: mxfp4-quantized experts (GPT-OSS's release layout) are not supported",
            hint="dequantize to bfloat16 first: load with transformers' "
            "Mxfp4Config(dequantize=True) and save_pretrained",
        )
    if method == "fp8":
        block = _block(quant.get("weight_block_size"), f"{where}.weight_block_size")
        suffix = "_scale_inv"
    elif method == "fbgemm_fp8":
        block, suffix = PER_CHANNEL, "_scale"
    elif method == "compressed-tensors":
        block, suffix = _compressed_tensors(quant, where), "_scale"
    else:
        raise ModelError(
            f"{where}.quant_method {method!r} is not supported (neffkit reads unquantized "
            "float32/bfloat16/float16 checkpoints and fp8 ones: fp8 block, compressed-tensors "
            "fp8, fbgemm_fp8)",
            hint="dequantize the checkpoint first (transformers: load it, then save_pretrained "
            "with an unquantized torch_dtype)",
        )
    return block, suffix


def _block(value: Any, where: str) -> tuple[int, int]:
    if not (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(b, int) and b > 0 for b in value)
    ):
        raise ModelError(f"{where}: {value!r} is not a block shape [out, in] of positive ints")
    return (int(value[0]), int(value[1]))


def _compressed_tensors(quant: dict[str, Any], where: str) -> tuple[int, int]:
    """The one fp8 weight scheme of a compressed-tensors config (every group must agree)."""
    if quant.get("format") not in ("float-quantized", "naive-quantized"):
        raise ModelError(
            f"{where}.format {quant.get('format')!r} is not supported (neffkit reads "
            "compressed-tensors fp8 weights: format float-quantized)"
        )
    schemes = set()
    for group, body in (quant.get("config_groups") or {}).items():
        w = (body or {}).get("weights") or {}
        at = f"{where}.config_groups.{group}.weights"
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ModelError(
                f"{at}: {w.get('type')!r} with {w.get('num_bits')!r} bits is not supported "
                "(neffkit reads 8-bit float weights)"
            )
        strategy = w.get("strategy")
        if strategy == "block":
            schemes.add(_block(w.get("block_structure"), f"{at}.block_structure"))
        elif strategy in CT_STRATEGIES:
            schemes.add(CT_STRATEGIES[strategy])
        else:
            raise ModelError(
                f"{at}.strategy {strategy!r} is not supported (tensor, channel or block)"
            )
    if len(schemes) != 1:
        raise ModelError(
            f"{where}.config_groups: {len(schemes)} weight schemes; neffkit reads exactly one"
        )
    return schemes.pop()
