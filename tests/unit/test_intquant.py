"""neffkit's one integer layout: packed codes, group scales, the four ways codes become values,
and the manifest's own int8 / int4 quantization (kernels/intquant.py, checkpoints/requantize.py).
"""

from __future__ import annotations

import pytest
import torch

from neffkit.checkpoints.quantized import QuantTensor
from neffkit.checkpoints.requantize import excluded, manifest_scheme, quantize, quantizes
from neffkit.errors import ModelError
from neffkit.kernels.intquant import (
    FP4_VALUES,
    HIGH,
    MIN,
    SCALE,
    ZERO,
    QuantScheme,
    dequantize,
    pack_codes,
    quantize_tokens,
    unpack_codes,
)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_codes_pack_to_their_width_and_unpack_exactly(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    stored_bits = sum(t.numel() * 8 for t in packed.values())
    assert stored_bits == codes.numel() * bits  # 6-bit codes cost 6 bits, not 8
    assert torch.equal(unpack_codes(packed[""], packed.get(HIGH), bits), codes)
    if bits == 4:  # element 2i in the low nibble, 2i+1 in the high one
        assert int(packed[""][0, 0, 0]) == int(codes[0, 0, 0]) | int(codes[0, 0, 1]) << 4


@pytest.mark.parametrize(
    "scheme",
    [
        QuantScheme("sym", 4, 32, zero=8),
        QuantScheme("zero", 4, 64),
        QuantScheme("min", 5, 32),
        QuantScheme("sym", 6, 16, zero=32),
        QuantScheme("e2m1", 4, 32),
        QuantScheme("sym", 8, 0, zero=128, activations="int8-token"),
        QuantScheme("min", 4, 32, activations="int8-block"),
    ],
    ids=lambda s: s.to_id(),
)
def test_scheme_ids_round_trip_and_name_their_stored_parts(scheme):
    assert QuantScheme.from_id(scheme.to_id()) == scheme
    stored = scheme.stored((96, 128))
    assert stored[""][0] == ((96, 128) if scheme.bits == 8 else (96, 64))
    assert stored[SCALE][0] == (96, 128 // scheme.group_of(128))
    assert (HIGH in stored) == (scheme.bits in (5, 6))
    assert set(stored) - {"", HIGH, SCALE} == ({scheme.aux} if scheme.aux else set())


def test_each_kind_widens_by_its_formula_in_float32():
    """The graph's widening is the defining libraries' arithmetic, element by element."""
    rows, cols, group = 4, 64, 32
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.uint8)
    scale = torch.rand(rows, cols // group) + 0.01
    aux = torch.randn(rows, cols // group)
    per = lambda t: t.repeat_interleave(group, dim=-1)  # noqa: E731
    c = codes.float()
    cases = {
        QuantScheme("sym", 4, group, zero=8): (c - 8) * per(scale),
        QuantScheme("zero", 4, group): (c - per(aux)) * per(scale),
        QuantScheme("min", 4, group): c * per(scale) + per(aux),
        QuantScheme("e2m1", 4, group): torch.tensor(FP4_VALUES)[codes.long()] * per(scale),
    }
    for scheme, expected in cases.items():
        parts = {**pack_codes(codes, 4), SCALE: scale}
        if scheme.aux:
            parts[scheme.aux] = aux
        assert torch.equal(dequantize(parts, scheme, torch.float32), expected), scheme
    assert ZERO != MIN


def test_manifest_int8_is_symmetric_per_output_channel():
    w = torch.randn(16, 48)
    q = quantize(w, manifest_scheme("int8"))
    assert q.scheme == QuantScheme("sym", 8, 0, zero=128)
    assert q.scale.shape == (16, 1)
    assert torch.allclose(q.scale[:, 0], w.abs().amax(-1) / 127)
    widened = q.dequantized()
    assert (widened - w).abs().max() <= q.scale.max() / 2 + 1e-6  # round to nearest
    assert int(q.codes.min()) >= 1 and int(q.codes.max()) <= 255  # [-127, 127] + 128


def test_manifest_int4_groups_round_to_nearest_within_seven_steps():
    w = torch.randn(8, 128)
    q = quantize(w, manifest_scheme("int4:32"))
    assert q.scheme == QuantScheme("sym", 4, 32, zero=8)
    assert q.scale.shape == (8, 4)
    assert int(q.codes.max()) <= 15
    err = (q.dequantized() - w).abs().reshape(8, 4, 32)
    assert bool((err <= q.scale.unsqueeze(-1) / 2 + 1e-6).all())
    assert torch.equal(torch.zeros(2, 32), quantize(torch.zeros(2, 32), q.scheme).dequantized())


def test_the_manifest_quantizes_projections_and_the_head_less_what_it_excludes():
    assert quantizes("model.layers.0.self_attn.q_proj.weight", tied=False)
    assert quantizes("lm_head.weight", tied=False)
    assert quantizes("model.embed_tokens.weight", tied=True)  # the tied table is the head
    assert not quantizes("model.embed_tokens.weight", tied=False)
    assert not quantizes("model.layers.0.input_layernorm.weight", tied=False)
    assert not quantizes("model.layers.0.self_attn.kv_b_proj.weight", tied=False)
    assert excluded("lm_head.weight", ("lm_head",), tied=False)
    assert excluded("model.embed_tokens.weight", ("lm_head",), tied=True)
    assert excluded("model.layers.3.mlp.down_proj.weight", ("mlp.down_proj",), tied=False)
    assert excluded("model.layers.0.mlp.up_proj.weight", ("model.layers.0.*",), tied=False)
    assert not excluded("model.layers.1.mlp.up_proj.weight", ("model.layers.0.*",), tied=False)


def test_per_token_activation_quantization_is_absmax_over_127_half_to_even():
    x = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]])
    q, scale = quantize_tokens(x)
    assert torch.equal(scale, torch.tensor([[1.0 / 127], [1.0]]))
    assert torch.equal(q[0], torch.round(x[0] * 127))
    assert torch.equal(q[1], torch.zeros(3))


def test_parts_that_do_not_fit_their_weight_are_refused_naming_it():
    scheme = QuantScheme("zero", 4, 32)
    codes = torch.zeros(8, 64, dtype=torch.uint8)
    with pytest.raises(ModelError, match=r"'w'.*scales of shape \[8, 3\]"):
        QuantTensor(scheme, codes, torch.ones(8, 3), torch.zeros(8, 2)).check("w")
    with pytest.raises(ModelError, match="without its .qzero"):
        QuantTensor(scheme, codes, torch.ones(8, 2)).check("w")
    with pytest.raises(ModelError, match="not a whole number of groups"):
        QuantTensor(scheme, codes[:, :48], torch.ones(8, 2), torch.zeros(8, 2)).check("w")
    with pytest.raises(ModelError, match="exceed 4 bits"):
        QuantTensor(scheme, codes + 16, torch.ones(8, 2), torch.zeros(8, 2)).check("w")


def _manifest(model: object, **fields: object) -> dict:
    buckets = {"prefill": [16], "decode": [1], "context": [64]}
    return {"neffkit": 1, "model": str(model), "buckets": buckets, **fields}


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"weights": "int3"}, "quantization.weights: 'int3' is not supported"),
        ({"weights": "int8", "group_size": 32}, "quantization.group_size: int8 is per output"),
        ({"weights": "int4", "group_size": 48}, "quantization.group_size: 48 is not supported"),
        ({"weights": "int4", "exclude": "lm_head"}, "quantization.exclude: expected a list"),
        ({"weights": "int4", "bits": 4}, "quantization.bits: unknown key"),
    ],
)
def test_a_quantization_neffkit_does_not_implement_is_refused_naming_the_field(
    tmp_path, quantization, message
):
    from neffkit.errors import ManifestError
    from neffkit.manifest import parse_manifest
    from tests.conftest import DEMO_MODEL

    with pytest.raises(ManifestError) as err:
        parse_manifest(_manifest(DEMO_MODEL, quantization=quantization), tmp_path)
    assert err.value.message.startswith(message), err.value.message


def test_a_checkpoint_already_quantized_is_not_quantized_again(tmp_path):
    import json
    import shutil

    from neffkit.errors import ManifestError
    from neffkit.manifest import parse_manifest
    from tests.conftest import DEMO_MODEL

    model = tmp_path / "awq"
    shutil.copytree(DEMO_MODEL, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ManifestError, match=r"already quantized \(awq\)"):
        parse_manifest(_manifest(model, quantization={"weights": "int8"}), tmp_path)


def test_a_tp_cut_inside_a_group_is_refused_naming_the_layout(tmp_path):
    """The demo model's o_proj reads 256 inputs: at tp=4 each rank keeps 64, not a group of 128."""
    from neffkit.compile.layout import model_layout
    from neffkit.errors import ModelError
    from neffkit.manifest import parse_manifest
    from tests.conftest import DEMO_MODEL

    data = _manifest(
        DEMO_MODEL, parallel={"tp": 4}, quantization={"weights": "int4", "group_size": 128}
    )
    manifest = parse_manifest(data, tmp_path)
    with pytest.raises(ModelError) as err:
        model_layout(manifest, "cpu")
    assert err.value.field == "parallel.tp"
    assert "o_proj" in err.value.message and "groups of 128" in err.value.message
