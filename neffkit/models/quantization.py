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
    if method in INT_METHODS or method == "gguf" or _ct_int(quant):
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
        check_mxfp4(quant, where, cfg)
    elif method == "gguf":
        check_gguf(quant, path, where)
    elif _ct_int(quant):
        check_compressed_int(quant, where)
        method = "compressed-tensors"
    else:
        return "", ()
    frozen = _frozen(quant)
    return str(method), frozen


def _one_of(
    quant: dict[str, Any], key: str, allowed: tuple[int, ...], where: str, reads: str
) -> int:
    """quant[key], refused by name unless one of `allowed` (`reads`: what neffkit reads)."""
    value = quant.get(key)
    if value not in allowed:
        raise ModelError(f"{where}.{key}: {value!r} is not supported (neffkit reads {reads})")
    return int(value)


def _bits(quant: dict[str, Any], key: str, allowed: tuple[int, ...], where: str) -> int:
    return _one_of(quant, key, allowed, where, f"{' or '.join(map(str, allowed))}-bit weights")


def _group(quant: dict[str, Any], key: str, allowed: tuple[int, ...], where: str) -> int:
    reads = f"group sizes {', '.join(map(str, allowed))}"
    return _one_of(quant, key, allowed, where, reads)


def check_gguf(quant: dict[str, Any], path: Path, where: str) -> None:
    """A GGUF file's metadata directory (checkpoints/gguf_dir.py): its pointer beside config.json.
    transformers' own GGUF quantization_config (a model saved after loading a GGUF file) names
    weights neffkit does not read."""
    pointer = quant.get("neffkit_pointer")
    if not isinstance(pointer, str) or not (path.parent / pointer).is_file():
        raise ModelError(
            f"{where}.quant_method 'gguf' without the GGUF file neffkit reads the tensors from",
            hint="give the .gguf file itself as `model: FILE.gguf`, or convert it to float: "
            "neffkit convert FILE.gguf -o DIR",
        )


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
    """GPTQ (AutoGPTQ, GPTQModel, optimum): 4- or 8-bit, symmetric, groups (or -1: per
    channel), desc_act false, int32 words, checkpoint_format gptq (v1: zero points stored less
    one) or gptq_v2, one scheme for every module."""
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
    key = "checkpoint_format" if quant.get("checkpoint_format") else "format"
    fmt = str(quant.get(key) or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2") or quant.get("is_marlin_format"):
        shown = "marlin" if quant.get("is_marlin_format") else fmt
        raise ModelError(
            f"{where}.{key}: {shown!r} is not supported (gptq, gptq_v2)",
            hint="save the model in GPTQ's own layout (GPTQModel: format=FORMAT.GPTQ)",
        )
    if str(quant.get("pack_dtype", "int32")) != "int32":
        raise ModelError(
            f"{where}.pack_dtype: {quant.get('pack_dtype')!r} is not supported (int32 words)"
        )
    if quant.get("dynamic"):
        raise ModelError(
            f"{where}.dynamic: per-module overrides are not supported (neffkit reads one "
            "GPTQ scheme for every quantized module)",
            hint="re-quantize without `dynamic`",
        )


MXFP4_KEYS = ("quant_method", "modules_to_not_convert")


def check_mxfp4(quant: dict[str, Any], where: str, cfg: dict[str, Any]) -> None:
    """GPT-OSS's release layout (checkpoints/formats/mxfp4.py): its experts in mxfp4, the
    modules `modules_to_not_convert` names stored float (read as they are)."""
    if cfg.get("model_type") != "gpt_oss":
        raise ModelError(
            f"{where}.quant_method: mxfp4 on model_type {cfg.get('model_type')!r} is not "
            "supported (neffkit reads mxfp4 as GPT-OSS ships it: model_type gpt_oss)"
        )
    for key in quant:
        if key not in MXFP4_KEYS:
            raise ModelError(
                f"{where}.{key}: not supported for mxfp4 (neffkit reads "
                f"{', '.join(MXFP4_KEYS)}: GPT-OSS's release config)",
                hint="dequantize the checkpoint, or remove the option if it only asks "
                "transformers how to load it",
            )
    keep = quant.get("modules_to_not_convert")
    if keep is not None and not (isinstance(keep, list) and all(isinstance(m, str) for m in keep)):
        raise ModelError(f"{where}.modules_to_not_convert: {keep!r} is not a list of names")


def check_compressed_int(quant: dict[str, Any], where: str) -> None:
    """compressed-tensors pack-quantized (W4A16, W8A16: 4- or 8-bit, symmetric or with zero
    points, per group or per channel) and int-quantized (W8A8: symmetric int8 per channel with
    dynamic per-token int8 activations): every group one integer weight scheme."""
    fmt = quant.get("format")
    for key in ("transform_config", "sparsity_config"):
        if quant.get(key):
            raise ModelError(
                f"{where}.{key}: {quant[key]!r} is not supported (neffkit reads quantized "
                "weights without rotations or sparsity)",
                hint="export the model without the transform / sparsity modifier",
            )
    kv = quant.get("kv_cache_scheme")
    if isinstance(kv, dict) and kv.get("type") != "float":
        raise ModelError(
            f"{where}.kv_cache_scheme: {kv.get('type')!r} is not supported (neffkit's KV cache "
            "is the model dtype or fp8: manifest kv_cache.dtype)"
        )
    _strings(quant.get("ignore") or [], f"{where}.ignore")
    groups = quant.get("config_groups") or {}
    if not groups:
        raise ModelError(
            f"{where}.config_groups: none (nothing says how the format {fmt!r} weights are stored)"
        )
    for group, body in groups.items():
        at = f"{where}.config_groups.{group}"
        body = body or {}
        if body.get("format") not in (None, fmt):
            raise ModelError(
                f"{at}.format: {body.get('format')!r} beside {fmt!r} (mixed formats are not "
                "supported: every group stored as the checkpoint's format)"
            )
        _strings(body.get("targets"), f"{at}.targets", empty=False)
        _check_int_weights(body.get("weights") or {}, fmt, f"{at}.weights")
        if body.get("output_activations"):
            raise ModelError(f"{at}.output_activations: quantized outputs are not supported")
        acts = body.get("input_activations")
        if fmt == "int-quantized":
            _check_w8a8(body.get("weights") or {}, acts, at)
        elif acts:
            raise ModelError(
                f"{at}.input_activations: quantized activations need format int-quantized "
                "(W8A8); pack-quantized weights keep activations in the model dtype"
            )


def _strings(value: Any, where: str, empty: bool = True) -> None:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ModelError(f"{where}: {value!r} is not a list of module names or patterns")
    if not value and not empty:
        raise ModelError(f"{where}: empty (no module is quantized by this group)")


def _check_int_weights(w: dict[str, Any], fmt: Any, at: str) -> None:
    bits = (4, 8) if fmt == "pack-quantized" else (8,)
    if w.get("type") != "int" or w.get("num_bits") not in bits:
        raise ModelError(
            f"{at}: {w.get('type')!r} with {w.get('num_bits')!r} bits is not supported "
            f"(neffkit reads {' and '.join(map(str, bits))}-bit int weights as {fmt})"
        )
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise ModelError(f"{at}.strategy: {strategy!r} is not supported (group, channel)")
    size = w.get("group_size")
    if strategy == "group" and not (isinstance(size, int) and size > 0):
        raise ModelError(f"{at}.group_size: {size!r} is not a positive group size")
    if w.get("dynamic"):
        raise ModelError(f"{at}.dynamic: {w.get('dynamic')!r} (weights are stored quantized)")
    if w.get("actorder") not in (None, False, "static", "weight"):
        raise ModelError(
            f"{at}.actorder: {w.get('actorder')!r} is not supported (neffkit reads groups in "
            "input order: actorder static or weight)",
            hint="re-quantize with actorder 'static' or 'weight' (llm-compressor's GPTQModifier)",
        )


def _check_w8a8(w: dict[str, Any], acts: Any, at: str) -> None:
    if w.get("num_bits") != 8 or not w.get("symmetric", True) or w.get("strategy") != "channel":
        raise ModelError(
            f"{at}.weights: W8A8 reads symmetric 8-bit per-channel weights (got "
            f"{w.get('num_bits')}-bit, symmetric {w.get('symmetric', True)}, strategy "
            f"{w.get('strategy')!r})"
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
            "symmetric per-token int8 activations)",
            hint="static or asymmetric activation scales: re-export with llm-compressor's "
            "W8A8 preset (dynamic per-token), or a weight-only scheme",
        )
