"""Quantized checkpoints: which quantization_config layouts neffkit reads (fp8 scales; integer
and fp4 formats kept at their width: AWQ, GPTQ, compressed-tensors int, mxfp4), and every other
one refused by name.

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
    if method in INT_METHODS or _ct_int(quant):
        return (), ""
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
            "float32/bfloat16/float16 checkpoints, fp8 ones (fp8 block, compressed-tensors "
            "fp8, fbgemm_fp8), awq, gptq, compressed-tensors int and mxfp4; GGUF files as "
            "`model: FILE.gguf`)",
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


INT_METHODS = ("awq", "gptq", "mxfp4")
CT_INT_FORMATS = ("pack-quantized", "int-quantized")


def _ct_int(quant: dict[str, Any]) -> bool:
    return quant.get("quant_method") == "compressed-tensors" and quant.get("format") in (
        CT_INT_FORMATS
    )


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def weight_format(cfg: dict[str, Any], path: Path) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """(format, its quantization_config as sorted pairs) of an integer or fp4 checkpoint kept
    at its width; ("", ()) for float and fp8 checkpoints. The options each format reads are
    checked here (pure Python, before any weight is read); one it does not implement is refused
    by name with what to do."""
    quant = cfg.get("quantization_config")
    if not isinstance(quant, dict):
        return "", ()
    method = quant.get("quant_method")
    where = f"{path}: quantization_config"
    if method == "awq":
        check_awq(quant, where)
    elif method == "gptq":
        check_gptq(quant, where)
    elif method == "mxfp4":
        pass
    elif _ct_int(quant):
        check_compressed_int(quant, where)
        method = "compressed-tensors"
    else:
        return "", ()
    frozen = _frozen(quant)
    return str(method), frozen


def _bits(quant: dict[str, Any], key: str, allowed: tuple[int, ...], where: str) -> int:
    bits = quant.get(key)
    if bits not in allowed:
        raise ModelError(
            f"{where}.{key}: {bits!r} is not supported (neffkit reads "
            f"{' or '.join(map(str, allowed))}-bit weights)"
        )
    return int(bits)


def _group(quant: dict[str, Any], key: str, allowed: tuple[int, ...], where: str) -> int:
    group = quant.get(key)
    if group not in allowed:
        raise ModelError(
            f"{where}.{key}: {group!r} is not supported (neffkit reads group sizes "
            f"{', '.join(map(str, allowed))})"
        )
    return int(group)


def check_awq(quant: dict[str, Any], where: str) -> None:
    """AutoAWQ's GEMM layout, 4-bit, zero points, groups of 32/64/128."""
    _bits(quant, "bits", (4,), where)
    _group(quant, "group_size", (32, 64, 128), where)
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelError(
            f"{where}.version: {version!r} is not supported (neffkit reads AWQ's GEMM layout)",
            hint="re-export the model with AutoAWQ's version='GEMM'",
        )
    if quant.get("zero_point") is False:
        raise ModelError(f"{where}.zero_point: false is not supported (AWQ with zero points)")


def check_gptq(quant: dict[str, Any], where: str) -> None:
    """GPTQ: 4- or 8-bit, symmetric, groups (or -1: per channel), desc_act false."""
    _bits(quant, "bits", (4, 8), where)
    group = quant.get("group_size", 128)
    if not (group == -1 or group in (32, 64, 128)):
        raise ModelError(f"{where}.group_size: {group!r} is not supported (32, 64, 128 or -1)")
    if quant.get("desc_act"):
        raise ModelError(
            f"{where}.desc_act: true (act-order) is not supported",
            hint="re-quantize with desc_act=False, or use an AWQ or compressed-tensors export",
        )
    if quant.get("sym") is False:
        raise ModelError(f"{where}.sym: false is not supported (neffkit reads symmetric GPTQ)")
    fmt = str(quant.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelError(f"{where}.checkpoint_format: {fmt!r} is not supported (gptq, gptq_v2)")


def check_compressed_int(quant: dict[str, Any], where: str) -> None:
    """compressed-tensors pack-quantized (W4A16, W8A16) and int-quantized (W8A8, dynamic
    per-token int8 activations): every group one integer weight scheme."""
    groups = quant.get("config_groups") or {}
    if not groups:
        raise ModelError(f"{where}.config_groups: none (nothing says how weights are stored)")
    for group, body in groups.items():
        at = f"{where}.config_groups.{group}"
        w = (body or {}).get("weights") or {}
        if w.get("type") != "int" or w.get("num_bits") not in (4, 8):
            raise ModelError(
                f"{at}.weights: {w.get('type')!r} with {w.get('num_bits')!r} bits is not "
                "supported (neffkit reads 4- and 8-bit int weights)"
            )
        strategy = w.get("strategy")
        if strategy not in ("group", "channel"):
            raise ModelError(
                f"{at}.weights.strategy: {strategy!r} is not supported (group, channel)"
            )
        if strategy == "group" and w.get("group_size") not in (32, 64, 128):
            raise ModelError(
                f"{at}.weights.group_size: {w.get('group_size')!r} is not supported (32, 64, 128)"
            )
        if w.get("actorder") not in (None, False, "static"):
            raise ModelError(f"{at}.weights.actorder: {w.get('actorder')!r} is not supported")
        acts = (body or {}).get("input_activations")
        if quant.get("format") == "int-quantized":
            _check_w8a8(w, acts, at)
        elif acts:
            raise ModelError(
                f"{at}.input_activations: quantized activations need format int-quantized"
            )


def _check_w8a8(w: dict[str, Any], acts: Any, at: str) -> None:
    if w.get("num_bits") != 8 or not w.get("symmetric", True) or w.get("strategy") != "channel":
        raise ModelError(
            f"{at}.weights: W8A8 reads symmetric 8-bit per-channel weights (got "
            f"{w.get('num_bits')}-bit, strategy {w.get('strategy')!r})"
        )
    ok = (
        isinstance(acts, dict)
        and acts.get("type") == "int"
        and acts.get("num_bits") == 8
        and acts.get("dynamic") is True
        and acts.get("strategy") == "token"
        and acts.get("symmetric", True)
    )
    if not ok:
        raise ModelError(
            f"{at}.input_activations: {acts!r} is not supported (neffkit reads dynamic "
            "symmetric per-token int8 activations)"
        )
