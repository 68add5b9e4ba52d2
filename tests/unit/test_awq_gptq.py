"""AWQ and GPTQ checkpoints read at their width: the decoders against the libraries' layouts
(words written by hand, the writers of tests/support/awq_gptq.py, AutoAWQ's and vLLM's own
dequantization transcribed), and every refusal by name: config options neffkit does not read,
act-order g_idx, tensors whose shapes do not fit. No build, no model run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from neffkit.checkpoints.formats import format_for
from neffkit.checkpoints.formats.awq import AwqFormat
from neffkit.checkpoints.formats.gptq import GptqFormat
from neffkit.checkpoints.quantized import QuantTensor, SafetensorsSource
from neffkit.errors import ModelError
from neffkit.kernels.intquant import QuantScheme
from neffkit.models.quantization import weight_format
from tests.support.awq_gptq import (
    awq_config,
    awq_quantize,
    gptq_config,
    gptq_quantize,
    pack_awq,
    pack_gptq,
    widened,
)

M = "model.layers.0.mlp.down_proj"
DTYPES = {torch.int32: "I32", torch.int64: "I64", torch.float16: "F16", torch.float32: "F32"}


def _headers(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    return {n: {"dtype": DTYPES[t.dtype], "shape": list(t.shape)} for n, t in tensors.items()}


def _decode(fmt, tensors: dict[str, torch.Tensor]) -> QuantTensor:
    entries = fmt.entries(_headers(tensors))
    assert list(entries) == [f"{M}.weight"]
    entry = entries[f"{M}.weight"]
    tensor = fmt.decode(f"{M}.weight", entry, tensors.__getitem__)
    tensor.check(f"{M}.weight")
    assert tensor.scheme == entry.scheme and tensor.shape == entry.shape
    return tensor


def _awq(out: int = 64, rows: int = 256, group: int = 128, seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    codes, zeros, scales = awq_quantize(torch.randn(out, rows), group)
    parts = pack_awq(codes, zeros, scales)
    return {f"{M}.{k}": v for k, v in parts.items()}, (codes, zeros, scales)


def _gptq(bits: int, group: int, fmt: str = "gptq", out: int = 64, rows: int = 256) -> tuple:
    torch.manual_seed(1)
    codes, zeros, scales = gptq_quantize(torch.randn(out, rows), bits, group)
    parts = pack_gptq(codes, zeros, scales, **gptq_config(bits, group, fmt))
    return {f"{M}.{k}": v for k, v in parts.items()}, (codes, zeros, scales)


# ---------------------------------------------------------------- AWQ


def test_awq_word_order_is_autoawq_s():
    """Columns 0..7 holding 1..8 pack into nibbles (low first) 1,3,5,7,2,4,6,8: AWQ_ORDER
    [0, 2, 4, 6, 1, 3, 5, 7] (AutoAWQ's from_linear), so the word is 0x86427531."""
    word = torch.tensor(0x86427531 - 2**32, dtype=torch.int32)
    tensors = {
        f"{M}.qweight": word.expand(32, 1).contiguous(),
        f"{M}.qzeros": torch.tensor([[0x11111111]], dtype=torch.int32),
        f"{M}.scales": torch.full((1, 8), 0.5, dtype=torch.float16),
    }
    t = _decode(AwqFormat(awq_config(32)), tensors)
    assert t.codes[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]  # [out, in]: transposed
    assert t.aux is not None and t.aux.flatten().tolist() == [1.0] * 8
    assert t.dequantized()[:, 5].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]


@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_round_trip_and_autoawq_s_dequantization(group):
    tensors, (codes, zeros, scales) = _awq(group=group)
    t = _decode(AwqFormat(awq_config(group)), tensors)
    assert t.scheme == QuantScheme("zero", 4, group)
    assert torch.equal(t.codes, codes.to(torch.uint8))
    assert t.aux is not None and torch.equal(t.aux, zeros.float())
    assert torch.equal(t.scale, scales.float()) and t.scale.dtype == torch.float32
    assert torch.equal(t.dequantized(), widened(codes, zeros, scales))
    # AutoAWQ's dequantize_gemm (packing_utils.py), in float32: unpack each word low nibble
    # first, undo the order, (iweight - izeros) * scales per group, [in, out]
    shifts = torch.arange(0, 32, 4)
    reverse = (torch.arange(codes.shape[0]).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3, 7]]).flatten()

    def unpack(words):
        return ((words[:, :, None] >> shifts) & 15).flatten(1)[:, reverse]

    iweight, izeros = unpack(tensors[f"{M}.qweight"]), unpack(tensors[f"{M}.qzeros"])
    s = tensors[f"{M}.scales"].float().repeat_interleave(group, 0)
    reference = (iweight - izeros.repeat_interleave(group, 0)).float() * s
    assert torch.equal(t.dequantized(), reference.t())


def test_awq_through_a_safetensors_checkpoint(tmp_path: Path):
    """The source lists the logical weight, hides the stored parts, passes a bias through."""
    tensors, (codes, zeros, scales) = _awq()
    bias = torch.randn(64, dtype=torch.float16)
    save_file({**tensors, f"{M}.bias": bias}, str(tmp_path / "model.safetensors"))
    fmt = format_for("awq", awq_config(128))
    assert isinstance(fmt, AwqFormat)
    source = SafetensorsSource(tmp_path, fmt)
    try:
        assert source.names == {f"{M}.weight", f"{M}.bias"}
        assert source.shape(f"{M}.weight") == (64, 256) and source.dtype(f"{M}.weight") == "Q"
        assert torch.equal(source.read(f"{M}.bias"), bias)
        weight = source.read(f"{M}.weight")
        assert isinstance(weight, QuantTensor)
        assert torch.equal(weight.dequantized(), widened(codes, zeros, scales))
    finally:
        source.close()


# ---------------------------------------------------------------- GPTQ


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_word_order_and_the_zero_point_off_by_one(fmt):
    """Inputs 0..7 holding 1..8 pack low first into 0x87654321; zero point 8 is stored as 7
    (0x77777777) in v1 and as 8 in gptq_v2: both read 8."""
    stored = 0x77777777 if fmt == "gptq" else 0x88888888 - 2**32
    tensors = {
        f"{M}.qweight": torch.full((4, 8), 0x87654321 - 2**32, dtype=torch.int32),
        f"{M}.qzeros": torch.full((1, 1), stored, dtype=torch.int32),
        f"{M}.scales": torch.full((1, 8), 0.25, dtype=torch.float16),
        f"{M}.g_idx": torch.zeros(32, dtype=torch.int32),
    }
    t = _decode(GptqFormat(gptq_config(4, 32, fmt)), tensors)
    assert t.scheme == QuantScheme("sym", 4, 32, zero=8) and t.aux is None
    assert t.codes[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8] * 4  # [out, in]
    assert t.dequantized()[0, :8].tolist() == [-1.75, -1.5, -1.25, -1.0, -0.75, -0.5, -0.25, 0]


@pytest.mark.parametrize(
    ("bits", "group", "fmt"),
    [(4, 32, "gptq"), (4, 128, "gptq_v2"), (8, -1, "gptq"), (8, 64, "gptq_v2"), (4, -1, "gptq")],
)
def test_gptq_round_trip_and_vllm_s_dequantization(bits, group, fmt):
    tensors, (codes, zeros, scales) = _gptq(bits, group, fmt)
    t = _decode(GptqFormat(gptq_config(bits, group, fmt)), tensors)
    assert t.scheme == QuantScheme("sym", bits, max(group, 0), zero=2 ** (bits - 1))
    assert torch.equal(t.codes, codes.to(torch.uint8))
    groups = 1 if group < 0 else 256 // group
    assert torch.equal(t.scale, scales.float()) and t.scale.shape == (64, groups)
    assert torch.equal(t.dequantized(), widened(codes, zeros, scales))
    # vLLM's GPTQ fallback (gptq.py): fields low bits first, zeros masked (+1 in v1), then
    # scales[g_idx] * (weight - zeros[g_idx]), [in, out]
    shifts = torch.arange(0, 32, bits)
    mask = 2**bits - 1
    qweight, qzeros = tensors[f"{M}.qweight"], tensors[f"{M}.qzeros"]
    weight = ((qweight[:, None, :] >> shifts[None, :, None]) & mask).flatten(0, 1)
    z = ((qzeros[:, :, None] >> shifts) & mask).flatten(1) + (fmt == "gptq")
    g_idx = tensors[f"{M}.g_idx"].long()
    reference = tensors[f"{M}.scales"].float()[g_idx] * (weight - z[g_idx]).float()
    assert torch.equal(t.dequantized(), reference.t())


def test_gptq_v2_zeros_read_as_v1_are_refused_by_name():
    """A v1 checkpoint (zeros stored as 7) declared gptq_v2 would widen every weight off by one
    step: its zero points are refused, not read as an asymmetric scheme."""
    tensors, _ = _gptq(4, 32, "gptq")
    fmt = GptqFormat(gptq_config(4, 32, "gptq_v2"))
    with pytest.raises(ModelError, match=r"down_proj.qzeros.*zero points are all 8; .*\[7\]"):
        _decode(fmt, tensors)


def test_gptq_act_order_g_idx_is_refused_by_name():
    tensors, _ = _gptq(4, 32)
    g_idx = tensors[f"{M}.g_idx"]
    tensors[f"{M}.g_idx"] = g_idx[torch.randperm(256, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(ModelError, match=r"down_proj.g_idx'.*input order.*act-order") as e:
        _decode(GptqFormat(gptq_config(4, 32)), tensors)
    assert "desc_act=False" in (e.value.hint or "")


# ---------------------------------------------------------------- shapes, refused in entries()


def _refused(fmt, tensors: dict[str, torch.Tensor], pattern: str) -> None:
    with pytest.raises(ModelError, match=pattern):
        fmt.entries(_headers(tensors))


def test_awq_shapes_that_do_not_fit_are_refused_naming_the_tensor():
    awq = AwqFormat(awq_config(128))
    tensors, _ = _awq()
    _refused(awq, {**tensors, f"{M}.scales": torch.zeros(2, 72).half()}, r"down_proj.scales'")
    _refused(awq, {**tensors, f"{M}.scales": torch.zeros(1, 64).half()}, r"\[1, 64\].*\[2, 64\]")
    _refused(awq, {**tensors, f"{M}.qzeros": torch.zeros(2, 4).int()}, r"down_proj.qzeros'")
    odd = {**tensors, f"{M}.qweight": torch.zeros(192, 8, dtype=torch.int32)}
    _refused(awq, odd, r"down_proj.qweight'.*192 inputs.*groups of 128")
    _refused(awq, {**tensors, f"{M}.qweight": torch.zeros(256, 8)}, r"qweight' is F32")
    missing = {k: v for k, v in tensors.items() if not k.endswith("qzeros")}
    _refused(awq, missing, r"down_proj.qzeros' is missing")
    orphan = {k: v for k, v in tensors.items() if not k.endswith("qweight")}
    _refused(awq, orphan, r"down_proj.qzeros' has no .*down_proj.qweight")
    both = {**tensors, f"{M}.weight": torch.zeros(64, 256)}
    _refused(awq, both, r"both a float weight and a qweight")


def test_gptq_shapes_that_do_not_fit_are_refused_naming_the_tensor():
    gptq = GptqFormat(gptq_config(4, 32))
    tensors, _ = _gptq(4, 32)
    _refused(gptq, {**tensors, f"{M}.scales": torch.zeros(8, 32).half()}, r"down_proj.scales'")
    wide = {**tensors, f"{M}.qzeros": torch.zeros(8, 16).int()}
    _refused(gptq, wide, r"down_proj.qzeros'.*must be \[8, 8\]")
    _refused(gptq, {**tensors, f"{M}.g_idx": torch.zeros(128).int()}, r"down_proj.g_idx'")
    odd = {**tensors, f"{M}.qweight": torch.zeros(2, 64, dtype=torch.int32)}  # 16 inputs
    _refused(gptq, odd, r"down_proj.qweight'.*16 inputs in groups of 32")
    _refused(gptq, {**tensors, f"{M}.scales": torch.zeros(8, 64).int()}, r"scales' is I32")
    narrow = {**tensors, f"{M}.qweight": torch.zeros(32, 60, dtype=torch.int32)}
    _refused(gptq, narrow, r"60 outputs packed 8 a word")
    orphan = {k: v for k, v in tensors.items() if not k.endswith("qweight")}
    _refused(gptq, orphan, r"has no .*down_proj.qweight")


def test_gptq_without_g_idx_reads_groups_in_input_order():
    tensors, (codes, zeros, scales) = _gptq(4, 32)
    del tensors[f"{M}.g_idx"]
    t = _decode(GptqFormat(gptq_config(4, 32)), tensors)
    assert torch.equal(t.dequantized(), widened(codes, zeros, scales))


# ---------------------------------------------------------------- config checks, by name


def _config_refused(quant: dict, pattern: str) -> None:
    with pytest.raises(ModelError, match=pattern):
        weight_format({"quantization_config": quant}, Path("m/config.json"))


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"desc_act": True}, r"m/config.json: quantization_config.desc_act: true \(act-order\)"),
        ({"bits": 3}, r"quantization_config.bits: 3 is not supported"),
        ({"bits": 2}, r"quantization_config.bits: 2 is not supported"),
        ({"group_size": 16}, r"quantization_config.group_size: 16 is not supported"),
        ({"sym": False}, r"quantization_config.sym: false"),
        ({"checkpoint_format": "marlin"}, r"checkpoint_format: 'marlin' is not supported"),
        ({"checkpoint_format": "", "format": "bitblas"}, r"\.format: 'bitblas' is not"),
        ({"is_marlin_format": True}, r"'marlin' is not supported"),
        ({"pack_dtype": "int16"}, r"quantization_config.pack_dtype: 'int16'"),
        ({"dynamic": {"-:.*down": {}}}, r"quantization_config.dynamic: per-module"),
    ],
)
def test_gptq_configs_neffkit_does_not_read_are_refused(change, pattern):
    _config_refused({**gptq_config(4, 32), **change}, pattern)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"bits": 8}, r"quantization_config.bits: 8 is not supported"),
        ({"group_size": 256}, r"quantization_config.group_size: 256"),
        ({"version": "gemv"}, r"quantization_config.version: 'gemv'"),
        ({"zero_point": False}, r"quantization_config.zero_point: false"),
    ],
)
def test_awq_configs_neffkit_does_not_read_are_refused(change, pattern):
    _config_refused({**awq_config(128), **change}, pattern)


def test_the_configs_the_writers_make_are_read():
    path = Path("m/config.json")
    assert weight_format({"quantization_config": awq_config(128)}, path)[0] == "awq"
    for bits, group, fmt in ((4, 32, "gptq"), (8, -1, "gptq_v2")):
        quant = gptq_config(bits, group, fmt)
        assert weight_format({"quantization_config": quant}, path)[0] == "gptq"
        assert isinstance(format_for("gptq", quant), GptqFormat)
