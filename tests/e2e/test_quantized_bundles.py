"""Quantized weights in a bundle as `neffkit inspect` shows them (and a pack keeps them), and on
the neuron target: every scheme's widening lowered to HLO and run on XLA:CPU against the eager
values, and a quantized Llama lowered at tp=2 whose XLA:CPU tokens equal HF's on the float twin
(the twin of tests/e2e/test_quantization.py: weights replaced by their quantized values by the
formula the docs give).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from safetensors import safe_open

from neffkit.contract.bundle import read_zst_text
from tests.e2e.test_quantization import ONE_DECODE, twin
from tests.support import REPO
from tests.support.bundles import build_session_bundle, lowered_build
from tests.support.cli import bundle_json, run_cli
from tests.support.models import COMMON, LONG, MAX_NEW, MIXED, SHORT

INT4_G32 = {"weights": "int4", "group_size": 32}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _inspect(target: Path) -> dict:
    return json.loads(run_cli("inspect", str(target), "--json", check=True).stdout)


def test_inspect_shows_each_quantized_weight_and_a_pack_keeps_them(
    hf_model_dir, session_dir, tmp_path
):
    """One row per weight (its codes and scales together), by scheme, the totals against
    float32, all read from bundle.json and the shard headers; the sizes checked against the
    shard itself. (The bundle is test_quantization.py's int4 build: the same manifest, one
    build.)"""
    from neffkit.contract.pack import pack_bundle

    result = build_session_bundle(
        session_dir, hf_model_dir("llama"), "int4_g32", buckets=ONE_DECODE, quantization=INT4_G32
    )
    record = bundle_json(result.bundle)
    quant = dict(record["model"]["weight_quant"])
    layers = COMMON["num_hidden_layers"]
    assert len(quant) == 7 * layers + 1 and set(quant.values()) == {"sym:b4:g32:z8"}
    assert record["model"]["weight_format"] == ""  # a float checkpoint, quantized by the build
    report = _inspect(result.bundle)
    jsonschema.validate(report, json.loads((REPO / "docs" / "inspect.schema.json").read_text()))
    q = report["quantization"]
    assert (q["from"], q["format"], q["ranks"]) == ("manifest", "manifest", 1)
    assert q["options"] == {**INT4_G32, "exclude": [], "activations": ""}
    with safe_open(str(result.bundle / "weights" / "rank0.safetensors"), "pt") as f:
        stored = {n: f.get_slice(n).get_shape() for n in f.keys()}  # noqa: SIM118
    values = 0
    for row in q["weights"]:
        out, cols = row["shape"]
        assert stored[row["name"]] == [out, cols // 2]  # two codes a byte
        assert stored[row["name"] + ".qscale"] == [out, cols // 32]
        assert (row["kind"], row["bits"], row["group"], row["zero"]) == ("sym", 4, 32, 8)
        assert row["codes_bytes"] == out * cols // 2 and row["scale_bytes"] == out * cols // 8
        assert row["aux_bytes"] == row["high_bytes"] == 0
        assert row["bits_per_weight"] == 5.0  # 4 bits and a float32 scale per 32
        values += out * cols
    assert {r["name"] for r in q["weights"]} == set(quant)
    assert q["totals"] == {
        "weights": len(quant),
        "bytes": values * 5 // 8,
        "float32_bytes": values * 4,
        "bits_per_weight": 5.0,
    }
    assert [s["scheme"] for s in q["schemes"]] == ["sym:b4:g32:z8"]
    text = run_cli("inspect", str(result.bundle), check=True).stdout
    assert "manifest int4 (group 32): 15 weights" in text and "int4 sym (zero 8)" in text
    assert "model.layers.1.mlp.down_proj.weight" in text
    # a pack carries the files byte for byte: the same codes at 4 bits, the same report
    pack = pack_bundle(result.bundle, tmp_path / "int4.tar.zst")
    packed = _inspect(pack)
    assert packed["quantization"] == q


def _lowered_dequantize(
    scheme_id: str,
) -> tuple[np.ndarray, torch.Tensor, dict[str, torch.Tensor], str]:
    """`dequantize` of random codes (every code of the width in the first row) lowered for
    neuron and run on XLA:CPU: (XLA's values, the eager ones, the stored parts, HLO text)."""
    from neffkit.compile.backends.neuron.lower import lower_program
    from neffkit.kernels.intquant import HIGH, SCALE, QuantScheme, dequantize, pack_codes
    from neffkit.platform.xla_cpu import XlaCpu

    scheme = QuantScheme.from_id(scheme_id)
    out, cols = 8, 64
    group = scheme.group_of(cols)

    class Widen(torch.nn.Module):
        def forward(self, *stored: torch.Tensor) -> tuple[torch.Tensor]:
            parts = dict(zip(names, stored, strict=True))
            return (dequantize(parts, scheme, torch.float32),)

    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 1 << scheme.bits, (out, cols), generator=gen, dtype=torch.uint8)
    codes[0] = torch.arange(cols) % (1 << scheme.bits)
    parts = pack_codes(codes, scheme.bits)
    parts[SCALE] = torch.rand(out, cols // group, generator=gen) + 0.01
    if scheme.aux:
        parts[scheme.aux] = torch.randn(out, cols // group, generator=gen)
    names = ["", *(s for s in (HIGH, SCALE, scheme.aux) if s in parts)]
    inputs = [parts[n] for n in names]
    program = torch.export.export(Widen(), tuple(inputs))
    lowered = lower_program(program, [f"part{i}" for i in range(len(inputs))], (), 1)
    xla = XlaCpu(1)
    run = xla.run(xla.compile(lowered.proto), [xla.put(t.numpy()) for t in inputs])
    return np.asarray(run[0]), Widen()(*inputs)[0], parts, lowered.text


def test_unsigned_shifts_lower_as_logical_shifts():
    """Every uint8 value shifted by 0 to 9 bits both ways, by a tensor and by a constant: XLA:CPU
    gives torch's values (torch-mlir alone lowers a tensor shift right to XLA's signed shift,
    0xF0 >> 4 = 0xFF, and a constant shift not at all)."""
    from neffkit.compile.backends.neuron.lower import lower_program
    from neffkit.platform.xla_cpu import XlaCpu

    class Shifts(torch.nn.Module):
        def forward(self, x: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
            col = x.unsqueeze(-1)
            return col >> k, col << k, x >> 4, x << 3

    x = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    k = torch.arange(10, dtype=torch.uint8)
    lowered = lower_program(torch.export.export(Shifts(), (x, k)), ["x", "k"], (), 1)
    assert "shift" not in lowered.text and "power(" not in lowered.text  # integers only
    xla = XlaCpu(1)
    got = xla.run(xla.compile(lowered.proto), [xla.put(x.numpy()), xla.put(k.numpy())])
    for value, want in zip(got, Shifts()(x, k), strict=True):
        assert np.array_equal(np.asarray(value), want.numpy())


@pytest.mark.parametrize(
    "scheme",
    [
        "sym:b4:g32:z8",  # manifest int4, GGUF Q4_0 (g32)
        "sym:b8:g0:z128",  # manifest int8, per output channel
        "zero:b4:g32",  # AWQ, GPTQ, asymmetric compressed-tensors
        "sym:b6:g16:z32",  # Q6_K: a nibble plane and a 2-bit plane
        "min:b5:g32",  # Q5_1 / Q5_K: a nibble plane and a 1-bit plane
        "e2m1:b4:g32",  # mxfp4
    ],
)
def test_every_scheme_lowers_for_neuron_and_widens_on_xla_cpu(scheme):
    """Unsigned shifts lower as integer division (never XLA's signed shift), the fp4 values
    are computed (no table: no lifted constant, no gather), no f64 and no hazard in the
    HLO. The values are the eager ones bit for bit; `code * scale + min` XLA:CPU contracts
    into one fused multiply-add, so kind min is that rounded once."""
    from neffkit.audit.hlo import hlo_hazards
    from neffkit.kernels.intquant import HIGH, MIN, SCALE, unpack_codes

    got, want, parts, text = _lowered_dequantize(scheme)
    if scheme.startswith("min"):
        codes = unpack_codes(parts[""], parts.get(HIGH), 5).double()
        scale, low = (parts[k].double().repeat_interleave(32, -1) for k in (SCALE, MIN))
        want = (codes * scale + low).float()  # the product exact in float64: one rounding
    assert np.array_equal(got.view(np.uint32), want.numpy().view(np.uint32)), scheme
    assert re.search(r"u8\[8,\d+\]\{1,0\} parameter\(0\)", text)  # the codes stay bytes
    assert "shift-right" not in text and "gather" not in text and "f64[" not in text
    assert {h.rule for h in hlo_hazards(text)} <= {"NK305"}  # informational only


@pytest.mark.full  # two tp=2 lowerings (~75 s each here) and their XLA:CPU runs
@pytest.mark.parametrize(
    ("spec", "bits", "group"),
    [(INT4_G32, 4, 32), ({"weights": "int8"}, 8, 0)],
    ids=["int4", "int8"],
)
def test_quantized_llama_at_tp2_on_xla_cpu_equals_hf(
    spec, bits, group, hf_model_dir, session_dir, hf_greedy
):
    """The neuron target at tp=2: uint8 codes and float32 scales are HLO parameters, widened
    next to each `dot` (dequantize-then-dot); `build --verify` runs both ranks on XLA:CPU
    against the eager model, and `run --executor xla-cpu` gives HF's greedy tokens on the
    twin whose weights are the quantized values."""
    model = hf_model_dir("llama")
    bundle = lowered_build(
        session_dir,
        model,
        f"llama_{spec['weights']}_neuron_tp2",
        "--lower-only",
        "--verify",
        buckets=ONE_DECODE,
        parallel={"tp": 2},
        quantization=spec,
    )
    record = bundle_json(bundle)
    for g in record["graphs"]:
        assert g["verify"]["ok"] and g["verify"]["tokens_equal"], g["verify"]
        assert "2 host devices" in g["verify"]["executor"]
        hlo = read_zst_text(bundle / g["hlo_text"])
        assert re.search(r"u8\[[\d,]+\]\{1,0\} parameter", hlo) and "all-reduce(" in hlo
    findings = _inspect(bundle)["findings"]
    assert [f for f in findings if f["severity"] == "error"] == []
    prompts = [SHORT, LONG, *MIXED]
    args = [arg for p in prompts for arg in ("--prompt-ids", ",".join(map(str, p)))]
    run = ("run", str(bundle), "--executor", "xla-cpu", "--max-tokens", str(MAX_NEW))
    proc = run_cli(*run, *args, "--ignore-eos", "--json", check=True)
    got = [o["token_ids"] for o in json.loads(proc.stdout)["outputs"]]
    oracle = twin(model, bits, group)
    assert got == [hf_greedy(oracle, p, MAX_NEW) for p in prompts]
