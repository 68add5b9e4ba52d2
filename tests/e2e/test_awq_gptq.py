"""AWQ and GPTQ checkpoints build at their width and match HF: the bundle keeps each projection's
4-bit (or 8-bit) codes, its group scales and (AWQ) zero points, never a float copy, and its
greedy tokens equal HF float32 on the twin whose weights are exactly (q - z) * scale.

The checkpoints are tiny random Llamas written in AutoAWQ's and GPTQModel's layouts by
tests/support/awq_gptq.py (the libraries' packing, not neffkit's decoder). AWQ groups of 128
need 128 inputs per rank: its model is 256 wide, so tp=2 cuts o_proj into whole groups.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from tests.support.awq_gptq import PROJECTIONS, awq_config, gptq_config, make_pair
from tests.support.bundles import build_session_bundle, prebuild
from tests.support.cli import bundle_json, run_ids
from tests.support.models import COMMON, LONG, MAX_NEW, MIXED, SHORT

ONE_DECODE = {"prefill": [16], "decode": [1], "context": [64]}
# name → (model shape, quantization_config, the scheme every projection is read as)
MODELS = {
    "awq_g128": (
        {**COMMON, "hidden_size": 256, "intermediate_size": 512},
        awq_config(128),
        "zero:b4:g128",
    ),
    "gptq_b4_g32": (
        {**COMMON, "hidden_size": 128, "intermediate_size": 256},
        gptq_config(4, 32),  # checkpoint_format gptq: zero points stored less one
        "sym:b4:g32:z8",
    ),
    "gptq_b8_ch": (
        {**COMMON, "hidden_size": 128, "intermediate_size": 256},
        gptq_config(8, -1, "gptq_v2"),
        "sym:b8:g0:z128",
    ),
}


def _build(session_dir: Path, name: str, tp: int = 1) -> Path:
    shape, quant, _ = MODELS[name]
    model, _ = make_pair(name, shape, quant)
    return build_session_bundle(
        session_dir, model, f"{name}_tp{tp}", buckets=ONE_DECODE, parallel={"tp": tp}
    ).bundle


@prebuild("awq_g128_tp1")
def build_awq_bundle(session_dir: Path, hf_model_dir) -> Path:
    return _build(session_dir, "awq_g128")


def build_gptq_bundle(session_dir: Path, hf_model_dir) -> Path:
    return _build(session_dir, "gptq_b4_g32")


def _check_stored(bundle: Path, name: str, tp: int) -> None:
    """Every rank stores each projection as uint8 codes (two a byte at 4 bits) with float32
    scales per group and, for AWQ, float32 zero points: nothing else of it, no float copy; the
    graphs widen it by the format's scheme."""
    _, quant, scheme = MODELS[name]
    bits, group, zeros = quant["bits"], quant["group_size"], scheme.startswith("zero")
    projections = []
    for layer in range(COMMON["num_hidden_layers"]):
        for proj in PROJECTIONS:
            kind = "self_attn" if proj[0] in "qkvo" else "mlp"
            projections.append(f"model.layers.{layer}.{kind}.{proj}.weight")
    for rank in range(tp):
        with safe_open(str(bundle / "weights" / f"rank{rank}.safetensors"), "pt") as f:
            stored = {n: (f.get_slice(n).get_dtype(), f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
        for w in projections:
            dtype, (rows, packed) = stored[w]
            groups = packed * 8 // bits // group if group > 0 else 1
            assert dtype == "U8", (rank, w)
            want = {w + ".qscale": ("F32", [rows, groups])}
            if zeros:
                want[w + ".qzero"] = ("F32", [rows, groups])
            assert {n: stored[n] for n in stored if n.startswith(w + ".")} == want, (rank, w)
        assert stored["model.embed_tokens.weight"][0] == "F32"
        assert stored["lm_head.weight"][0] == "F32"  # neither config quantizes the head
    quantized = dict(bundle_json(bundle)["model"]["weight_quant"])
    assert {quantized.get(w) for w in projections} == {scheme}


def _parity(bundle: Path, name: str, hf_greedy) -> None:
    shape, quant, _ = MODELS[name]
    _, twin = make_pair(name, shape, quant)
    prompts = [SHORT, LONG, *MIXED]
    assert run_ids(bundle, prompts) == [hf_greedy(twin, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.full)])
def test_awq_g128_equals_hf_on_the_twin(tp, session_dir, hf_greedy, hf_model_dir):
    """AutoAWQ GEMM, 4-bit, zero points per group of 128; at tp=2 o_proj and down_proj are cut
    along their inputs between whole groups, the rest along their outputs."""
    if tp == 1:
        bundle = build_awq_bundle(session_dir, hf_model_dir)
    else:
        bundle = _build(session_dir, "awq_g128", tp)
    _parity(bundle, "awq_g128", hf_greedy)
    _check_stored(bundle, "awq_g128", tp)


@pytest.mark.full  # AWQ's build covers the default suite's integer path; GPTQ in test-all
def test_gptq_4bit_g32_equals_hf_on_the_twin(session_dir, hf_greedy, hf_model_dir):
    """GPTQModel's checkpoint_format gptq (v1): zero points stored as 7 and read as 8, so the
    scheme is symmetric and the bundle stores no zero points."""
    bundle = build_gptq_bundle(session_dir, hf_model_dir)
    _parity(bundle, "gptq_b4_g32", hf_greedy)
    _check_stored(bundle, "gptq_b4_g32", 1)


@pytest.mark.full  # the 8-bit, per-channel, gptq_v2 variant of the build above
def test_gptq_8bit_per_channel_v2_equals_hf_on_the_twin(session_dir, hf_greedy):
    bundle = _build(session_dir, "gptq_b8_ch")
    _parity(bundle, "gptq_b8_ch", hf_greedy)
    _check_stored(bundle, "gptq_b8_ch", 1)
