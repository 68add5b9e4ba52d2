"""GPT-OSS's mxfp4 experts read at their width (checkpoints/formats/mxfp4.py): decoded exactly as
transformers widens them, cut by GPT-OSS's sharding rules into every layout with the twin's
values, and everything the format does not read refused by name. No build, no HF model run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from neffkit.checkpoints.formats.mxfp4 import Mxfp4Format, e8m0_scales
from neffkit.checkpoints.quantized import QuantTensor, SafetensorsSource
from neffkit.errors import ModelError
from neffkit.kernels.intquant import QuantScheme, graph_weights
from neffkit.models.parallel import Parallelism
from neffkit.models.quantization import weight_format
from neffkit.models.registry import read_model_config
from neffkit.models.weights import iter_rank_weights, rank_weight_plan
from tests.support.mxfp4 import QUANT_CONFIG, mxfp4_models

GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.layers.0.mlp.experts.down_proj"
E2M1 = QuantScheme("e2m1", 4, 32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _random_experts(experts: int, rows: int, groups: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Blocks of every code and scales of every finite e8m0 exponent (0: 2^-127, 254: 2^127)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 255, (experts, rows, groups), generator=gen, dtype=torch.uint8)
    scales.view(-1)[:3] = torch.tensor([0, 254, 127], dtype=torch.uint8)
    return {"_blocks": blocks, "_scales": scales}


def _checkpoint(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


def test_e8m0_scales_are_exact_powers_of_two_as_transformers_computes_them():
    e = torch.arange(255, dtype=torch.uint8)
    got = e8m0_scales(e)
    assert got.dtype == torch.float32
    assert got.tolist() == [2.0 ** (int(i) - 127) for i in e]  # exact, 2^-127 a subnormal
    want = torch.ldexp(torch.ones(255), e.to(torch.int32) - 127)  # convert_moe_packed_tensors'
    assert torch.equal(_bits(got), _bits(want))


def test_decode_equals_transformers_conversion_bit_for_bit(tmp_path):
    """Both projections, every code, exponents 0..254 (e = 254 times 6 is inf in both): the
    logical weights are HF's float layout with their groups along dim -2."""
    gate_up, down = _random_experts(3, 128, 2, seed=1), _random_experts(3, 64, 2, seed=2)
    tensors = {GATE_UP + k: v for k, v in gate_up.items()}
    tensors |= {DOWN + k: v for k, v in down.items()}
    tensors[GATE_UP + "_bias"] = torch.randn(3, 128)
    source = SafetensorsSource(_checkpoint(tmp_path, tensors), Mxfp4Format(QUANT_CONFIG))
    assert source.names == {GATE_UP, DOWN, GATE_UP + "_bias"}  # blocks and scales consumed
    assert source.shape(GATE_UP) == (3, 64, 128)  # [E, hidden, 2I]
    assert source.shape(DOWN) == (3, 64, 64)  # [E, I, hidden]
    assert source.scheme(GATE_UP) == E2M1 and source.dtype(DOWN) == "Q"
    assert source.scheme(GATE_UP + "_bias") is None
    for name, parts in ((GATE_UP, gate_up), (DOWN, down)):
        tensor = source.read(name)
        assert isinstance(tensor, QuantTensor) and tensor.group_dim == -2
        want = convert_moe_packed_tensors(parts["_blocks"], parts["_scales"], dtype=torch.float32)
        assert torch.equal(_bits(tensor.dequantized()), _bits(want)), name
        # per element, each scale covers 32 consecutive inputs down dim -2
        scale = tensor.expanded("scale")
        assert scale.shape == want.shape
        assert torch.equal(
            scale[:, 32:64], e8m0_scales(parts["_scales"][..., 1:2]).mT.expand(-1, 32, -1)
        )
    source.close()


def test_every_layout_widens_to_the_float_twins_cut():
    """The sharding rules run on codes and per-element scales: at tp=1, tp=2 (each expert's
    intermediate halved, on `down_proj` group boundaries) and tp=2 ep=2 (whole experts) every
    rank's experts are stored 4-bit and widen to exactly the twin's shards."""
    mx, twin = mxfp4_models()
    cfg, twin_cfg = read_model_config(mx), read_model_config(twin)
    assert cfg.weight_format == "mxfp4" and not twin_cfg.weight_format
    for par in (Parallelism(), Parallelism(tp=2), Parallelism(tp=2, ep=2)):
        for rank in range(par.tp):
            specs, schemes = rank_weight_plan(mx, cfg, "float32", par, rank)
            assert set(schemes) == {
                f"model.layers.{i}.moe.{w}" for i in (0, 1) for w in ("gate_up", "down")
            }
            assert set(schemes.values()) == {E2M1}
            stored = dict(iter_rank_weights(mx, cfg, "float32", par, rank))
            assert [(n, tuple(t.shape), t.dtype) for n, t in stored.items()] == [
                (n, tuple(s), d) for n, s, d in specs
            ]
            assert stored["model.layers.0.moe.gate_up"].dtype == torch.uint8
            widened = graph_weights(stored, schemes, torch.float32)
            want = dict(iter_rank_weights(twin, twin_cfg, "float32", par, rank))
            assert widened.keys() == want.keys()
            for name, tensor in want.items():
                assert torch.equal(widened[name], tensor), (par, rank, name)


def test_a_tp_cut_inside_a_group_is_refused_naming_the_tensor(tmp_path):
    """Intermediate 32 at tp=2 (ep=1): each rank's `down` would read 16 of a group's 32 inputs."""
    mx, _ = mxfp4_models()
    narrow = tmp_path / "narrow"
    shutil.copytree(mx, narrow)
    tensors = load_file(mx / "model.safetensors")
    for name in list(tensors):
        if ".experts.gate_up_proj" in name:  # gate/up interleaved: the first 32 of each
            tensors[name] = tensors[name][:, :64].contiguous()
        elif name.endswith(".experts.down_proj_blocks") or name.endswith("down_proj_scales"):
            tensors[name] = tensors[name][:, :, :1].contiguous()
    save_file(tensors, narrow / "model.safetensors")
    config = json.loads((narrow / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**config, "intermediate_size": 32}))
    cfg = read_model_config(narrow)
    assert rank_weight_plan(narrow, cfg, "float32", Parallelism(tp=2, ep=2), 0)[1]  # whole experts
    with pytest.raises(ModelError, match=r"'model\.layers\.0\.moe\.down'.*groups of 32"):
        rank_weight_plan(narrow, cfg, "float32", Parallelism(tp=2), 0)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"model_type": "llama"}, r"mxfp4 on model_type 'llama'.*gpt_oss"),
        (
            {"quantization_config": {**QUANT_CONFIG, "dequantize": True}},
            r"\.dequantize: not supported",
        ),
        (
            {"quantization_config": {**QUANT_CONFIG, "modules_to_not_convert": "lm_head"}},
            "not a list",
        ),
    ],
)
def test_config_options_it_does_not_read_are_refused_by_name(config, match):
    raw = {"model_type": "gpt_oss", "quantization_config": QUANT_CONFIG, **config}
    with pytest.raises(ModelError, match=match):
        weight_format(raw, Path("config.json"))


def test_the_release_config_is_read():
    raw = {"model_type": "gpt_oss", "quantization_config": QUANT_CONFIG}
    fmt, options = weight_format(raw, Path("config.json"))
    assert fmt == "mxfp4" and dict(options)["quant_method"] == "mxfp4"
    assert weight_format({**raw, "quantization_config": {"quant_method": "mxfp4"}}, Path("c"))[0]


@pytest.mark.parametrize(
    ("headers", "match"),
    [
        ({GATE_UP + "_blocks": ("U8", [2, 64, 2, 16])}, r"_blocks' has no scales"),
        (
            {GATE_UP + "_blocks": ("U8", [2, 64, 2, 16]), GATE_UP + "_scales": ("F32", [2, 64, 2])},
            r"_scales' is F32; mxfp4 blocks and scales are U8",
        ),
        (
            {GATE_UP + "_blocks": ("U8", [2, 64, 2, 16]), GATE_UP + "_scales": ("U8", [2, 64, 3])},
            r"blocks \[experts, rows, groups, 16\]",
        ),
        (
            {GATE_UP + "_blocks": ("U8", [2, 64, 2, 8]), GATE_UP + "_scales": ("U8", [2, 64, 2])},
            r"blocks \[experts, rows, groups, 16\]",
        ),
        (
            {
                "model.layers.0.self_attn.q_proj_blocks": ("U8", [64, 2, 16]),
                "model.layers.0.self_attn.q_proj_scales": ("U8", [64, 2]),
            },
            r"q_proj_blocks'.*expert projections",
        ),
        (
            {
                GATE_UP: ("F32", [2, 64, 64]),
                GATE_UP + "_blocks": ("U8", [2, 64, 2, 16]),
                GATE_UP + "_scales": ("U8", [2, 64, 2]),
            },
            "both as a float tensor and in mxfp4",
        ),
        ({"model.norm.weight": ("F32", [64])}, r"holds no `\*_blocks`"),
    ],
    ids=["no-scales", "scale-dtype", "scale-shape", "block-bytes", "not-experts", "twice", "none"],
)
def test_stored_tensors_that_do_not_fit_are_refused_by_name(headers, match):
    raw = {n: {"dtype": d, "shape": s} for n, (d, s) in headers.items()}
    with pytest.raises(ModelError, match=match):
        Mxfp4Format(QUANT_CONFIG).entries(raw)


def test_a_nan_scale_is_refused_naming_the_tensor(tmp_path):
    parts = _random_experts(2, 64, 2)
    parts["_scales"][1, 5, 0] = 255
    source = SafetensorsSource(
        _checkpoint(tmp_path, {GATE_UP + k: v for k, v in parts.items()}), Mxfp4Format(QUANT_CONFIG)
    )
    with pytest.raises(ModelError, match=r"gate_up_proj_scales'.*255 \(NaN\) at \[1, 5, 0\]"):
        source.read(GATE_UP)
    source.close()


def test_quant_tensor_checks_its_groups_along_dim_minus_2():
    """A scale that does not fit a [E, in, out] weight's groups along dim -2 is refused."""
    codes = torch.zeros(2, 64, 8, dtype=torch.uint8)
    QuantTensor(E2M1, codes, torch.ones(2, 2, 8), group_dim=-2).check("w")
    with pytest.raises(ModelError, match=r"'w': scales of shape \[2, 8, 1\]"):
        QuantTensor(E2M1, codes, torch.ones(2, 1, 8), group_dim=-2).check("w")
    with pytest.raises(ModelError, match="groups along dim 0"):
        QuantTensor(E2M1, codes, torch.ones(2, 2, 8), group_dim=0).check("w")
