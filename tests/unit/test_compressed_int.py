"""compressed-tensors integer checkpoints (checkpoints/formats/compressed.py): each weight is
decoded to exactly what the library's own compressors decompress it to, W8A8's activations are
quantized as vLLM's kernels do, and every layout or option neffkit does not read is refused by
name. The tensors here are written by compressed-tensors itself (its `calculate_qparams` and
the format's compressor), one module at a time: nothing is built and no model runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
from compressed_tensors.quantization import QuantizationScheme as CtScheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import save_file

from neffkit.checkpoints.formats.compressed import CompressedTensorsFormat
from neffkit.checkpoints.quantized import SafetensorsSource
from neffkit.errors import ModelError
from neffkit.kernels.intquant import (
    Int8Activations,
    QuantScheme,
    pack_codes,
    project_w8a8,
    quantize_tokens,
)
from neffkit.models.quantization import weight_format

UP = "model.layers.0.mlp.up_proj"
INT8_TOKEN = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


def _scheme(weights: dict[str, Any], acts: dict[str, Any] | None = None) -> CtScheme:
    args = QuantizationArgs(**weights)
    return CtScheme(
        targets=["Linear"],
        weights=args,
        input_activations=QuantizationArgs(**acts) if acts else None,
    )


def _config(fmt: str, scheme: CtScheme, ignore: list[str] | None = None) -> dict[str, Any]:
    """quantization_config as llm-compressor writes it (ModelCompressor.update_config)."""
    qc = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore or [], format=fmt)
    body = json.loads(qc.model_dump_json(exclude={"quant_method"}))
    return {
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        **body,
    }


def _compressed(
    fmt: str, scheme: CtScheme, weight: torch.Tensor, scale_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """One module's stored tensors: qparams from its groups' min and max, then the format's
    own compressor."""
    args = scheme.weights
    assert args is not None
    rows = weight.unflatten(-1, (-1, args.group_size)) if args.group_size else weight.unsqueeze(-2)
    scale, zero = calculate_qparams(rows.amin(-1), rows.amax(-1), args)
    state = {"weight": weight, "weight_scale": scale.to(scale_dtype), "weight_zero_point": zero}
    return dict(BaseCompressor.load_from_registry(fmt).compress(state, scheme))


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (signed zeros and all)."""
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return a.dtype == b.dtype and torch.equal(a.view(view[a.dtype]), b.view(view[b.dtype]))


def _source(tmp_path: Path, tensors: dict[str, torch.Tensor], quant: dict) -> SafetensorsSource:
    save_file(tensors, tmp_path / "model.safetensors")
    return SafetensorsSource(tmp_path, CompressedTensorsFormat(quant))


WEIGHT_ONLY = [
    {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128},
    {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
    {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "channel"},
    {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
    {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64},
]


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights", WEIGHT_ONLY, ids=lambda w: str(list(w.values())))
def test_pack_quantized_decodes_to_the_librarys_dequantization_bit_for_bit(
    tmp_path, weights, scale_dtype
):
    """20 outputs: asymmetric zero points are packed 8 (4-bit) or 4 (8-bit) a word down each
    column, so the last word is partly padding. In float32 the values are the library's exactly;
    with bfloat16 scales the library computes in bfloat16, and the float32 values round to it."""
    torch.manual_seed(0)
    weight = torch.randn(20, 256) * 0.05
    scheme = _scheme(weights)
    stored = _compressed("pack-quantized", scheme, weight, scale_dtype)
    assert stored["weight_packed"].dtype == torch.int32
    assert ("weight_zero_point" in stored) == (not weights["symmetric"])
    source = _source(
        tmp_path, {f"{UP}.{k}": v for k, v in stored.items()}, _config("pack-quantized", scheme)
    )
    assert source.names == {f"{UP}.weight"}
    q = source.read(f"{UP}.weight")
    bits, group = weights["num_bits"], weights.get("group_size") or 0
    want_scheme = (
        QuantScheme("sym", bits, group, zero=1 << (bits - 1))
        if weights["symmetric"]
        else QuantScheme("zero", bits, group)
    )
    assert q.scheme == want_scheme and q.shape == (20, 256)
    ours = q.dequantized()
    decompress = BaseCompressor.load_from_registry("pack-quantized").decompress
    library = decompress(stored, scheme)["weight"]
    assert library.dtype == scale_dtype
    assert _bits(ours.to(scale_dtype), library)
    in_float32 = decompress({**stored, "weight_scale": stored["weight_scale"].float()}, scheme)
    assert _bits(ours, in_float32["weight"])


W8A8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}


def test_int_quantized_w8a8_reads_the_int8_weight_with_per_token_activations(tmp_path):
    torch.manual_seed(1)
    weight = torch.randn(24, 128) * 0.05
    scheme = _scheme(W8A8, INT8_TOKEN)
    stored = _compressed("int-quantized", scheme, weight, torch.float32)
    assert stored["weight"].dtype == torch.int8 and set(stored) == {"weight", "weight_scale"}
    tensors = {f"{UP}.{k}": v for k, v in stored.items()}
    tensors["lm_head.weight"] = torch.randn(64, 128)  # ignored: float, passes as it is
    quant = _config("int-quantized", scheme, ignore=["lm_head"])
    source = _source(tmp_path, tensors, quant)
    assert source.scheme("lm_head.weight") is None and source.dtype("lm_head.weight") == "F32"
    q = source.read(f"{UP}.weight")
    assert q.scheme == QuantScheme("sym", 8, 0, zero=128, activations="int8-token")
    assert torch.equal(q.codes.to(torch.int16) - 128, stored["weight"].to(torch.int16))
    library = BaseCompressor.load_from_registry("int-quantized").decompress(stored, scheme)
    assert _bits(q.dequantized(), library["weight"])


def _vllm_tokens(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's dynamic_scaled_int8_quant (csrc/quantization/w8a8/int8/scaled_quant.cu) in numpy:
    scale absmax / 127, values rint(x * (127 / absmax)) saturated to int8."""
    amax = np.abs(x).max(-1, keepdims=True)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    return np.clip(np.rint(x * inverse), -128, 127), amax / np.float32(127)


def test_per_token_int8_activations_round_as_vllms_kernel():
    """The kernel multiplies by 127 / absmax; dividing by absmax / 127 instead rounds a few
    values in a million to the other integer. Rows here include such values."""
    torch.manual_seed(0)
    x = torch.randn(4096, 256)
    divided = torch.round(x / (x.abs().amax(-1, keepdim=True) / 127))
    q, scale = quantize_tokens(x)
    want_q, want_scale = _vllm_tokens(x.numpy())
    assert (divided != torch.from_numpy(want_q)).sum() > 0  # the rows tell the two apart
    assert torch.equal(q, torch.from_numpy(want_q))
    assert torch.equal(scale, torch.from_numpy(want_scale))


def test_w8a8_projection_scales_as_vllms_epilogue():
    """cutlass_scaled_mm's epilogue: x_scale * (w_scale * acc) in float32, acc the exact
    integer dot products (here 127 * 127 * 256 < 2^24: exact in float32 too)."""
    torch.manual_seed(2)
    x, w = torch.randn(7, 256), torch.randint(-127, 128, (48, 256), dtype=torch.int16)
    w_scale = torch.rand(48, 1) * 0.01
    parts = {**pack_codes((w + 128).to(torch.uint8), 8), ".qscale": w_scale}
    got = project_w8a8(x, Int8Activations(parts, QuantScheme("sym", 8, 0, 128, "int8-token")))
    q, x_scale = _vllm_tokens(x.numpy())
    acc = q @ w.numpy().astype(np.float32).T
    want = x_scale * (w_scale.numpy().reshape(-1) * acc)
    assert _bits(got, torch.from_numpy(want.astype(np.float32)))


def test_activation_order_is_read_only_in_input_order(tmp_path):
    torch.manual_seed(3)
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    scheme = _scheme({**weights, "group_size": 32})
    stored = _compressed("pack-quantized", scheme, torch.randn(16, 64), torch.float32)
    quant = _config("pack-quantized", scheme)
    trivial = torch.arange(64, dtype=torch.int32) // 32
    tensors = {f"{UP}.{k}": v for k, v in stored.items()}
    source = _source(tmp_path, {**tensors, f"{UP}.weight_g_idx": trivial}, quant)
    assert source.read(f"{UP}.weight").shape == (16, 64)
    source.close()
    shuffled = trivial.flip(0).contiguous()
    source = _source(tmp_path, {**tensors, f"{UP}.weight_g_idx": shuffled}, quant)
    with pytest.raises(ModelError, match=r"weight_g_idx': input 0 is in group 1, not 0"):
        source.read(f"{UP}.weight")


def test_a_weight_shape_the_packed_words_do_not_hold_is_refused(tmp_path):
    """250 inputs per channel: 32 words of 4-bit codes hold 256, and weight_shape says 250
    (neffkit reads inputs that fill whole words)."""
    scheme = _scheme({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"})
    stored = _compressed("pack-quantized", scheme, torch.randn(8, 250), torch.float32)
    source = _source(
        tmp_path, {f"{UP}.{k}": v for k, v in stored.items()}, _config("pack-quantized", scheme)
    )
    with pytest.raises(ModelError, match=r"weight_shape' says \[8, 250\].*hold \[8, 256\]"):
        source.read(f"{UP}.weight")


# ---------------------------------------------------------------- refusals


def _w4a16(**weights: Any) -> dict[str, Any]:
    base = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    return _config("pack-quantized", _scheme({**base, **weights}), ignore=["lm_head"])


def _w8a8(**acts: Any) -> dict[str, Any]:
    """W8A8 as llm-compressor writes it, the activations' fields replaced (raw JSON)."""
    quant = _config("int-quantized", _scheme(W8A8, INT8_TOKEN), ignore=["lm_head"])
    group = quant["config_groups"]["group_0"]
    return _group(quant, input_activations={**group["input_activations"], **acts})


def _group(quant: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """quant with config_groups.group_0 updated (raw JSON, past the library's validation)."""
    group = {**quant["config_groups"]["group_0"], **fields}
    return {**quant, "config_groups": {"group_0": group}}


def _weights(quant: dict[str, Any], **fields: Any) -> dict[str, Any]:
    group = quant["config_groups"]["group_0"]
    return _group(quant, weights={**group["weights"], **fields})


def test_the_configs_llm_compressor_writes_are_read():
    for quant in (
        _w4a16(),
        _w4a16(symmetric=False),
        _w4a16(num_bits=8, strategy="channel", group_size=None),
    ):
        fmt, options = weight_format({"quantization_config": quant}, Path("config.json"))
        assert fmt == "compressed-tensors" and dict(options)["format"] == "pack-quantized"
    assert weight_format({"quantization_config": _w8a8()}, Path("c"))[0] == "compressed-tensors"
    assert weight_format({"quantization_config": _w4a16(actorder="weight")}, Path("c"))[0]


REFUSED_CONFIGS = [
    (_weights(_w4a16(), num_bits=2), r"weights: 'int' with 2 bits is not supported"),
    (_weights(_w4a16(), type="float", num_bits=8), r"'float' with 8 bits"),
    (_weights(_w4a16(), strategy="tensor"), r"weights\.strategy: 'tensor' is not supported"),
    (_weights(_w4a16(), group_size=0), r"weights\.group_size: 0 is not a positive group size"),
    (_weights(_w4a16(), actorder="group"), r"weights\.actorder: 'group' is not supported"),
    (_weights(_w4a16(), dynamic=True), r"weights\.dynamic: True"),
    (_group(_w4a16(), input_activations=INT8_TOKEN), r"input_activations: quantized .* int-q"),
    (_group(_w4a16(), output_activations=INT8_TOKEN), r"output_activations: quantized outputs"),
    (_group(_w4a16(), format="int-quantized"), r"format: 'int-quantized' beside 'pack-quant"),
    (_group(_w4a16(), targets=[]), r"group_0\.targets: empty"),
    (_group(_w4a16(), targets="Linear"), r"group_0\.targets: 'Linear' is not a list"),
    ({**_w4a16(), "ignore": "lm_head"}, r"quantization_config\.ignore: 'lm_head' is not a list"),
    ({**_w4a16(), "config_groups": {}}, r"config_groups: none"),
    ({**_w4a16(), "transform_config": {"config_groups": {"u": {}}}}, r"transform_config: .*rot"),
    ({**_w4a16(), "sparsity_config": {"format": "sparse-24"}}, r"sparsity_config: .*sparsity"),
    ({**_w4a16(), "kv_cache_scheme": {"type": "int", "num_bits": 8}}, r"kv_cache_scheme: 'int'"),
    (_weights(_w8a8(), num_bits=4), r"'int' with 4 bits is not supported .* int-quantized"),
    (_weights(_w8a8(), strategy="group", group_size=128), r"W8A8 reads symmetric 8-bit per-ch"),
    (_weights(_w8a8(), symmetric=False), r"W8A8 reads .* symmetric False"),
    (
        _w8a8(dynamic=False, strategy="tensor"),
        r"input_activations: .* dynamic symmetric per-token int8",
    ),
    (_w8a8(symmetric=False), r"input_activations: .* dynamic symmetric per-token int8"),
    (_w8a8(strategy="tensor"), r"input_activations: .* dynamic symmetric per-token int8"),
    (_group(_w8a8(), input_activations=None), r"input_activations: None is not supported"),
]


@pytest.mark.parametrize(("quant", "match"), REFUSED_CONFIGS)
def test_options_neffkit_does_not_read_are_refused_by_name(quant, match):
    with pytest.raises(ModelError, match=match):
        weight_format({"quantization_config": quant}, Path("config.json"))


def _headers(**tensors: tuple[str, list[int]]) -> dict[str, dict]:
    """safetensors headers: NAME (dots as __) → (dtype, shape)."""
    return {n.replace("__", "."): {"dtype": d, "shape": s} for n, (d, s) in tensors.items()}


PACKED = {  # a 4-bit, group-128 symmetric q_proj [64, 256]
    "m__q__weight_packed": ("I32", [64, 32]),
    "m__q__weight_scale": ("BF16", [64, 2]),
    "m__q__weight_shape": ("I64", [2]),
}


def _entries(quant: dict[str, Any], headers: dict[str, dict]) -> dict:
    return CompressedTensorsFormat(quant).entries(headers)


def test_modules_take_the_group_that_names_them_else_the_class_targets():
    quant = _w4a16()
    by_name = _scheme({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"})
    groups = {
        **quant["config_groups"],
        "group_1": {
            **_config("pack-quantized", by_name)["config_groups"]["group_0"],
            "targets": ["re:.*\\.k$"],
        },
    }
    headers = _headers(
        **PACKED,
        m__k__weight_packed=("I32", [64, 64]),
        m__k__weight_scale=("F32", [64, 1]),
        m__k__weight_shape=("I64", [2]),
    )
    entries = _entries({**quant, "config_groups": groups}, headers)
    assert entries["m.q.weight"].scheme == QuantScheme("sym", 4, 128, zero=8)
    assert entries["m.k.weight"].scheme == QuantScheme("sym", 8, 0, zero=128)
    assert entries["m.k.weight"].shape == (64, 256)


REFUSED_HEADERS = [
    ({**PACKED, "m__q__weight_packed": ("I64", [64, 32])}, r"'m\.q\.weight_packed' is I64"),
    ({**PACKED, "m__q__weight_packed": ("I32", [64, 31])}, r"31 words .* do not hold .* 256"),
    ({**PACKED, "m__q__weight_scale": ("BF16", [32, 2])}, r"weight_scale' has shape \[32, 2\]"),
    ({**PACKED, "m__q__weight_scale": ("I8", [64, 2])}, r"weight_scale' is I8"),
    ({k: v for k, v in PACKED.items() if "shape" not in k}, r"weight_shape' is missing"),
    ({**PACKED, "m__q__weight": ("F32", [64, 256])}, r"both a float weight and a weight_packed"),
    ({**PACKED, "m__q__weight_zero_point": ("I32", [8, 2])}, r"symmetric .* with its weight_z"),
    ({**PACKED, "m__v__weight_zero_point": ("I32", [8, 2])}, r"'m\.v\.weight_zero_point' has no"),
    ({**PACKED, "m__q__weight_g_idx": ("I32", [128])}, r"weight_g_idx' has shape \[128\]"),
]


@pytest.mark.parametrize(("headers", "match"), REFUSED_HEADERS)
def test_stored_tensors_that_do_not_fit_are_refused_by_name(headers, match):
    with pytest.raises(ModelError, match=match):
        _entries(_w4a16(), _headers(**headers))


def test_zero_points_must_fit_their_packed_columns():
    headers = _headers(**PACKED, m__q__weight_zero_point=("I32", [64, 2]))
    with pytest.raises(ModelError, match=r"weight_zero_point' has shape \[64, 2\].*\[8, 2\]"):
        _entries(_w4a16(symmetric=False), headers)
    with pytest.raises(ModelError, match=r"an asymmetric scheme .* without its weight_zero"):
        _entries(_w4a16(symmetric=False), _headers(**PACKED))


def test_stored_modules_the_config_ignores_or_does_not_target_are_refused():
    quant = _w4a16()
    with pytest.raises(ModelError, match=r"'m\.q' is stored quantized but .*ignore lists it"):
        _entries({**quant, "ignore": ["re:m\\..*"]}, _headers(**PACKED))
    for targets in (["re:.*\\.k$"], ["lm_head"]):  # a lowercase name is a module, not a class
        named = _group(quant, targets=targets)
        with pytest.raises(ModelError, match=r"'m\.q' is stored quantized and 0 weight schemes"):
            _entries(named, _headers(**PACKED))
    two = {
        **quant["config_groups"]["group_0"],
        "weights": {**quant["config_groups"]["group_0"]["weights"], "num_bits": 8},
    }
    both = {**quant, "config_groups": {"a": quant["config_groups"]["group_0"], "b": two}}
    with pytest.raises(ModelError, match=r"2 weight schemes .* \(a, b\)"):
        _entries(both, _headers(**PACKED))


def _int8(module: str, weight: str = "I8", scale: tuple[int, int] = (64, 1)) -> dict[str, dict]:
    return {
        f"{module}.weight": {"dtype": weight, "shape": [64, 128]},
        f"{module}.weight_scale": {"dtype": "F32", "shape": list(scale)},
    }


@pytest.mark.parametrize(
    "module",
    [
        "model.embed_tokens",
        "model.layers.0.mlp.experts.3.up_proj",
        "model.layers.0.self_attn.kv_b_proj",
    ],
)
def test_w8a8_on_a_weight_no_projection_reads_is_refused_by_name(module):
    with pytest.raises(ModelError, match=rf"'{module}': W8A8 .* runs where a projection reads"):
        _entries(_w8a8(), _int8(module))
    assert _entries(_w8a8(), _int8("model.layers.0.mlp.up_proj"))  # a projection's is read


def test_int_quantized_tensors_that_do_not_fit_are_refused_by_name():
    with pytest.raises(ModelError, match=r"'m\.o\.weight' is F32 \[64, 128\]; .* as I8"):
        _entries(_w8a8(), _int8("m.o", weight="F32"))
    with pytest.raises(ModelError, match=r"'m\.o\.weight_scale' has shape \[64, 2\]"):
        _entries(_w8a8(), _int8("m.o", scale=(64, 2)))
    zero = {**_int8("m.o"), "m.o.weight_zero_point": {"dtype": "I8", "shape": [64, 1]}}
    with pytest.raises(ModelError, match=r"'m\.o\.weight_zero_point': format int-quantized"):
        _entries(_w8a8(), zero)
