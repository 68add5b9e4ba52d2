"""Projections that read integer / fp4 weights at their storage width (intquant.PackedWeight,
projection.project_packed): the values each form multiplies are exactly `dequantize`'s, the form
follows the row count as the policy says, and the decode form Inductor compiles streams the
packed bytes in a vector loop, with no float copy of the weight."""

from __future__ import annotations

import pytest
import torch

from neffkit.kernels.intquant import (
    HIGH,
    MIN,
    SCALE,
    ZERO,
    Int8Activations,
    PackedWeight,
    QuantScheme,
    dequantize,
    graph_weights,
    nibble_halves,
    pack_codes,
)
from neffkit.models.forms import PLAIN, ProjectionPolicy, takes_projection_form
from neffkit.models.projection import out_features, project_many, project_packed

CPU = ProjectionPolicy(max_rows=8, lanes=16)  # the cpu backend's row forms
CUDA = ProjectionPolicy(max_rows=1)
SCHEMES = [
    QuantScheme("sym", 4, 32, zero=8),  # the manifest's int4, Q4_0
    QuantScheme("sym", 4, 0, zero=8),  # one group a row
    QuantScheme("zero", 4, 128),  # AWQ / GPTQ
    QuantScheme("min", 4, 32),  # Q4_1 / Q4_K
    QuantScheme("e2m1", 4, 32),  # mxfp4
    QuantScheme("sym", 8, 0, zero=128),  # the manifest's int8
    QuantScheme("sym", 6, 16, zero=32),  # Q6_K: a high plane
    QuantScheme("min", 5, 32),  # Q5_1
]


def stored_parts(scheme: QuantScheme, out: int, inputs: int, seed: int = 0) -> dict:
    """Random codes and group parts as the bundle stores them (suffix → tensor)."""
    gen = torch.Generator().manual_seed(seed)
    groups = inputs // scheme.group_of(inputs)
    codes = torch.randint(0, 1 << scheme.bits, (out, inputs), dtype=torch.uint8, generator=gen)
    parts = {**pack_codes(codes, scheme.bits), SCALE: torch.rand(out, groups, generator=gen) / 64}
    if scheme.aux == ZERO:
        parts[ZERO] = torch.randint(0, 1 << scheme.bits, (out, groups), generator=gen).float()
    if scheme.aux == MIN:
        parts[MIN] = -torch.rand(out, groups, generator=gen) / 8
    return parts


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.to_id())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nibble_halves_are_the_even_and_odd_inputs_dequantized_exactly(scheme, dtype):
    parts = stored_parts(scheme, 24, 256)
    halves = nibble_halves(parts, scheme, dtype)
    if scheme.bits != 4:  # 8-bit codes are read as they are; 5/6 bits keep the widened form
        assert halves is None
        return
    assert halves is not None
    values = dequantize(parts, scheme, dtype)
    assert halves[0].dtype == halves[1].dtype == dtype
    assert torch.equal(halves[0], values[:, 0::2])
    assert torch.equal(halves[1], values[:, 1::2])


def test_an_odd_group_splits_a_byte_and_keeps_the_widened_form():
    scheme = QuantScheme("sym", 4, 3, zero=8)  # codes 2i, 2i+1 may lie in two groups
    assert nibble_halves(stored_parts(scheme, 4, 96), scheme, torch.float32) is None
    weight = PackedWeight(stored_parts(scheme, 4, 96), scheme, torch.float32)
    x = torch.randn(1, 96)
    assert torch.allclose(project_packed(x, weight, CPU), x @ weight.widened().t(), atol=1e-5)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.to_id())
@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_every_row_count_projects_onto_the_widened_weight(scheme, rows):
    """Up to max_rows rows: the packed row form (the same products, summed in another order:
    float tolerance); beyond: `mm`, on the widened weight (exactly the float form's result), or
    for 4-bit codes on its two nibble halves (two half-K products summed: tolerance)."""
    weight = PackedWeight(stored_parts(scheme, 48, 256, seed=rows), scheme, torch.float32)
    x = torch.randn(rows, 1, 256)
    want = x @ weight.widened().t()
    got = project_packed(x, weight, CPU)
    assert got.shape == (rows, 1, 48) and got.dtype == x.dtype
    halves = nibble_halves(weight.parts, scheme, torch.float32)
    if rows > CPU.max_rows and halves is None:
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(project_packed(x, weight, PLAIN), want)  # eager references: `dot`


def test_bf16_rows_read_the_bf16_values_and_return_bf16():
    scheme = QuantScheme("sym", 4, 32, zero=8)
    weight = PackedWeight(stored_parts(scheme, 32, 128), scheme, torch.bfloat16)
    x = torch.randn(2, 128).to(torch.bfloat16)
    got = project_packed(x, weight, CPU)
    want = x.float() @ weight.widened().float().t()  # the bf16 values, float32 products
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2)


def test_the_policy_picks_the_packed_form_by_row_count():
    assert [CPU.packed_form(r) for r in (1, 8, 9, 64)] == ["packed-rows"] * 2 + ["mm"] * 2
    assert [CUDA.packed_form(r) for r in (1, 2)] == ["packed-rows", "mm"]
    assert PLAIN.packed_form(1) == "dot"


def test_graph_weights_keep_projections_packed_and_widen_the_rest():
    int4, int8 = QuantScheme("sym", 4, 32, zero=8), QuantScheme("sym", 8, 0, zero=128)
    w8a8 = QuantScheme("sym", 8, 0, zero=128, activations="int8-token")
    names = {
        "model.layers.0.self_attn.q_proj.weight": int4,
        "model.embed_tokens.weight": int8,  # the tied table: the LM head too
        "model.layers.0.moe.gate_up": int4,  # experts: gathered per token, not projected
        "model.layers.0.mlp.down_proj.weight": w8a8,
    }
    w: dict[str, torch.Tensor] = {"model.norm.weight": torch.ones(128)}
    for i, (name, scheme) in enumerate(names.items()):
        w.update({name + s: t for s, t in stored_parts(scheme, 32, 128, seed=i).items()})
    widened = graph_weights(w, names, torch.float32)
    kept = graph_weights(w, names, torch.float32, takes_projection_form)
    assert widened.keys() == kept.keys() == {*names, "model.norm.weight"}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"):
        packed = kept[name]
        assert isinstance(packed, PackedWeight) and out_features(packed) == 32
        assert torch.equal(packed.widened(), widened[name])
    assert torch.equal(kept["model.layers.0.moe.gate_up"], widened["model.layers.0.moe.gate_up"])
    assert isinstance(kept["model.layers.0.mlp.down_proj.weight"], Int8Activations)
    assert not any(n.endswith((SCALE, HIGH)) for n in kept)


def test_project_many_reads_packed_and_float_weights_side_by_side():
    scheme = QuantScheme("zero", 4, 64)
    packed = PackedWeight(stored_parts(scheme, 32, 128), scheme, torch.float32)
    dense = torch.randn(16, 128)
    x = torch.randn(1, 1, 128)
    got = project_many(x, [packed, dense], CPU)
    assert torch.allclose(got[0], x @ packed.widened().t(), atol=1e-5)
    assert torch.allclose(got[1], x @ dense.t(), atol=1e-5)


def test_inductor_streams_the_packed_bytes_in_a_vector_loop():
    """The 1-row decode form compiled by Inductor (C++): one fused kernel that loads the packed
    codes 16 bytes at a time and widens them in registers: no `cat` unpacking the nibbles into
    a buffer, no float buffer of the weight, no scalar loop over the elements."""
    from torch._inductor.utils import run_and_get_code

    scheme = QuantScheme("sym", 4, 32, zero=8)
    parts = stored_parts(scheme, 64, 256)
    x = torch.randn(1, 256)

    def decode_row(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        weight = PackedWeight({"": codes, SCALE: scale}, scheme, torch.float32)
        return project_packed(x, weight, CPU)

    compiled = torch.compile(decode_row, backend="inductor", fullgraph=True)
    out, (code,) = run_and_get_code(compiled, x, parts[""], parts[SCALE])
    assert torch.allclose(out, x @ dequantize(parts, scheme, torch.float32).t(), atol=1e-5)
    assert "Vectorized<uint8_t>::loadu" in code
    assert "aten.cat" not in code and "(64, 256)" not in code  # no [out, in] buffer


def test_the_layout_records_the_packed_forms_and_ships_the_kernel_they_call(tmp_path):
    """bundle.json's projection form per graph, and whether the build ships the kernel library
    for them (4-bit groups of 32 and 8-bit channels on a float32 model: the kernel, where the
    host runs it)."""
    from neffkit.compile.layout import (
        packed_kernel_weights,
        projection_form,
        target_layout,
        uses_kernel,
    )
    from neffkit.manifest import parse_manifest
    from neffkit.platform import cpu_kernels
    from tests.conftest import DEMO_MODEL

    def layout(quantization: dict, **fields: object) -> object:
        buckets = {"prefill": [16], "decode": [1], "context": [64]}
        data = {"neffkit": 1, "model": str(DEMO_MODEL), "buckets": buckets, **fields}
        return target_layout(parse_manifest({**data, "quantization": quantization}, tmp_path))

    int4 = layout({"weights": "int4", "group_size": 32})
    int8 = layout({"weights": "int8"})
    kernel = cpu_kernels.supported()
    assert projection_form(int4, 1) == ("kernel-packed" if kernel else "packed-rows")
    assert projection_form(int8, 1) == projection_form(int4, 1)
    assert projection_form(int4, 16) == projection_form(int8, 16) == "mm"
    for quantized in (int4, int8):  # every projection and the head
        assert packed_kernel_weights(quantized) == [n for n, _ in quantized.config.weight_quant]
        assert uses_kernel(quantized) == kernel
    # an fp8 cache: no attention kernel, the packed weights alone call the library
    fp8_kv = layout({"weights": "int4", "group_size": 32}, kv_cache={"dtype": "float8_e4m3fn"})
    assert not fp8_kv.projection.attention_kernel
    assert uses_kernel(fp8_kv) == kernel
    bf16 = layout({"weights": "int8"}, dtype="bfloat16", kv_cache={"dtype": "float8_e4m3fn"})
    assert not packed_kernel_weights(bf16) and not uses_kernel(bf16)  # the kernel is float32


def test_int8_block_weights_read_their_rows_quantized_per_block():
    """Off the kernel, an int8-block weight's forms multiply the rows quantized per block of 32
    (and dequantized) by the weight's exact values: every row count, both nibble forms."""
    from neffkit.kernels.int8_blocks import fake_quantized, quantize_blocks

    scheme = QuantScheme("min", 4, 32, activations="int8-block")
    weight = PackedWeight(stored_parts(scheme, 48, 128), scheme, torch.float32)
    x = torch.randn(9, 128)
    x[0, :32] = 0  # an all-zero block: scale 1, values 0
    q, scale = quantize_blocks(x)
    assert q.abs().max() <= 127 and torch.equal(q, q.round())
    assert torch.equal(scale[0, 0], torch.ones(1))
    want = fake_quantized(x) @ weight.widened().t()
    for rows in (1, 8, 9):
        got = project_packed(x[:rows], weight, CPU)
        assert torch.allclose(got, want[:rows], rtol=1e-5, atol=1e-5), rows
    plain = x @ weight.widened().t()
    assert not torch.allclose(project_packed(x, weight, CPU), plain, rtol=1e-6, atol=1e-6)
