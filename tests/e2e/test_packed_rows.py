"""neffkit's C++ kernel for decode rows on 4- and 8-bit weights at their width
(neffkit::packed_rows, neffkit/platform/csrc/packed_rows.cpp) against `dequantize`: every weight
value bit for bit, every kind, group size and row count, the projection forms that call it, an
int8 bundle's decode graph, and the same checks on the AVX2 class's build ($NEFFKIT_CPU_ISA=avx2,
in a process of its own: one library a process), bit for bit this build's outputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from neffkit.kernels.intquant import SCALE, PackedWeight, QuantScheme, dequantize, kernel_table
from neffkit.models.forms import ProjectionPolicy
from neffkit.models.projection import kernel_reads, project_many, project_packed
from neffkit.platform import cpu_kernels, isa
from tests.support import REPO
from tests.support.cpu_class import BUILD_FAILED_ELSEWHERE, load_class_library
from tests.unit.test_packed_projection import stored_parts

pytestmark = pytest.mark.skipif(
    not cpu_kernels.supported(), reason="needs a CPU class the kernels are written for"
)

KERNEL = ProjectionPolicy(max_rows=8, lanes=16, kernel="auto")
INDUCTOR = ProjectionPolicy(max_rows=8, lanes=16)  # kernel "off": the packed-rows form
SCHEMES = [
    QuantScheme("sym", 4, 32, zero=8),  # the manifest's int4, Q4_0
    QuantScheme("sym", 4, 0, zero=8),
    QuantScheme("zero", 4, 64),  # AWQ / GPTQ
    QuantScheme("min", 4, 32),  # Q4_1 / Q4_K
    QuantScheme("e2m1", 4, 32),  # mxfp4
    QuantScheme("sym", 8, 32, zero=128),  # Q8_0, 8-bit GPTQ / compressed-tensors groups
    QuantScheme("sym", 8, 0, zero=128),  # the manifest's int8: per output channel
    QuantScheme("zero", 8, 64),
    QuantScheme("min", 8, 32),
]
ROWS = (1, 2, 3, 4, 5, 8)  # every tile of both classes and their remainders


def packed_rows(x: torch.Tensor, weights: list[dict], scheme: QuantScheme) -> torch.Tensor:
    base, mode = kernel_table(scheme, x.device)
    scales = [w[SCALE] for w in weights]
    aux = [w[scheme.aux] for w in weights] if scheme.aux else scales
    return torch.ops.neffkit.packed_rows(x, [w[""] for w in weights], scales, aux, base, mode)


@pytest.fixture(scope="module")
def op():
    cpu_kernels.ensure_for_tracing()
    return packed_rows


def check_values(scheme: QuantScheme) -> torch.Tensor:
    """One-hot rows pick single weight values out of the sums (x 1.0, plus zeros: exact)."""
    parts = stored_parts(scheme, 40, 128, seed=1)
    want = dequantize(parts, scheme, torch.float32)  # [40, 128]
    eye = torch.eye(128)
    got = torch.stack([packed_rows(eye[r0 : r0 + 8], [parts], scheme) for r0 in range(0, 128, 8)])
    for i in range(16):  # [8, 40]: columns 8i .. 8i+7 of W
        assert torch.equal(got[i], want[:, 8 * i : 8 * i + 8].t()), (scheme.to_id(), i)
    return got


def check_rows(scheme: QuantScheme, rows: int) -> torch.Tensor:
    """The widened matmul up to the float32 sum's order (37 outputs: every tile's remainder)."""
    parts = stored_parts(scheme, 37, 192, seed=rows)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    got = packed_rows(x, [parts], scheme)
    want = x @ dequantize(parts, scheme, torch.float32).t()
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return got


def check_one_call(scheme: QuantScheme) -> torch.Tensor:
    """Weights of one input in one call equal each alone."""
    weights = [stored_parts(scheme, n, 96, seed=n) for n in (48, 16, 21)]
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(3))
    together = packed_rows(x, weights, scheme)
    alone = torch.cat([packed_rows(x, [w], scheme) for w in weights], dim=-1)
    assert torch.equal(together, alone), scheme.to_id()
    return together


def every_check() -> dict[str, torch.Tensor]:
    """Every check on every scheme (what the AVX2 class's child runs): the outputs by name."""
    out = {}
    for scheme in SCHEMES:
        name = scheme.to_id()
        out[f"values {name}"] = check_values(scheme)
        out[f"one call {name}"] = check_one_call(scheme)
        for rows in ROWS:
            out[f"rows {name} {rows}"] = check_rows(scheme, rows)
    return out


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.to_id())
def test_every_weight_value_is_dequantize_s_bit_for_bit(op, scheme):
    check_values(scheme)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.to_id())
@pytest.mark.parametrize("rows", ROWS)
def test_packed_rows_equal_the_widened_matmul(op, scheme, rows):
    check_rows(scheme, rows)


@pytest.mark.parametrize("bits", [4, 8])
def test_weights_of_one_input_in_one_call_equal_each_alone(op, bits):
    check_one_call(QuantScheme("sym", bits, 32, zero=1 << (bits - 1)))


def test_layouts_the_kernel_does_not_read_are_refused_by_it(op):
    scheme = QuantScheme("sym", 4, 16, zero=8)  # a group of 8 code bytes
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.randn(1, 64), [stored_parts(scheme, 4, 64)], scheme)
    assert not kernel_reads(PackedWeight(stored_parts(scheme, 4, 64), scheme, torch.float32))
    six = QuantScheme("sym", 6, 32, zero=32)  # a high plane: Inductor's form
    assert not kernel_reads(PackedWeight(stored_parts(six, 4, 64), six, torch.float32))
    eight = QuantScheme("sym", 8, 0, zero=128)
    parts = stored_parts(eight, 4, 64)
    assert kernel_reads(PackedWeight(parts, eight, torch.float32))
    assert not kernel_reads(PackedWeight(parts, eight, torch.bfloat16))  # the twin's rounding
    codes, scales = [parts[""]], [parts[SCALE]]
    with pytest.raises(RuntimeError, match="codes must be uint8"):  # 8-bit codes, a 4-bit table
        torch.ops.neffkit.packed_rows(torch.randn(1, 64), codes, scales, scales, torch.ones(16), 0)
    base = torch.arange(256.0) - 127.5  # not code - an integer zero
    with pytest.raises(RuntimeError, match="8-bit base"):
        torch.ops.neffkit.packed_rows(torch.randn(1, 64), codes, scales, scales, base, 0)


@pytest.mark.parametrize("rows", [1, 4, 9])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernel_form_equals_inductor_s_form(op, rows, bits):
    """Up to max_rows rows the kernel form (q/k/v in one call); beyond, both widen to `mm`."""
    scheme = QuantScheme("zero", bits, 64)
    weights = [
        PackedWeight(stored_parts(scheme, n, 128, seed=n), scheme, torch.float32)
        for n in (64, 32, 32)
    ]
    assert KERNEL.packed_form(rows, kernel_reads(weights[0])) == (
        "kernel-packed" if rows <= 8 else "mm"
    )
    x = torch.randn(rows, 1, 128)
    got = project_many(x, weights, KERNEL)
    want = project_many(x, weights, INDUCTOR)
    for g, w, weight in zip(got, want, weights, strict=True):
        assert g.shape == (rows, 1, weight.out_features)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    single = project_packed(x, weights[0], KERNEL)
    torch.testing.assert_close(single, got[0], rtol=0, atol=0)


@pytest.mark.full  # test_quantization's int8 bundle (built there, under `make test-all`)
def test_an_int8_bundle_decodes_through_the_kernel(hf_model_dir, session_dir):
    """The manifest's int8 (per output channel, the LM head left in float): the decode graph
    reads the codes in the kernel, one byte a weight; the prefill graph's tokens widen them."""
    from tests.e2e.test_quantization import ONE_DECODE
    from tests.support.bundles import build_session_bundle
    from tests.support.cli import bundle_json

    result = build_session_bundle(
        session_dir,
        hf_model_dir("llama_tied"),
        "int8_tied_tp1",
        buckets=ONE_DECODE,
        parallel={"tp": 1},
        quantization={"weights": "int8", "exclude": ["lm_head"]},
    )
    data = bundle_json(result.bundle)
    forms = {g["phase"]: g["projection"].split("+") for g in data["graphs"]}
    assert "kernel-packed" in forms["decode"], forms
    assert "kernel-packed" not in forms["prefill"], forms
    assert data["kernels"] == ["kernels/libneffkit_cpu.so"]


def test_the_avx2_class_gives_the_same_bits(op, tmp_path):
    """Every check above on the library built for the AVX2 class (-march=x86-64-v3: two ymm a
    16-lane tile, its own tile widths) in one child process, and each output bit for bit this
    build's: every lane sums the same products in the same order."""
    if isa.requested() == "avx2":
        pytest.skip("this process builds for the AVX2 class: the tests above check it")
    out = tmp_path / "avx2.pt"
    child = [sys.executable, "-m", "tests.e2e.test_packed_rows", str(out)]
    env = {**os.environ, isa.ENV: "avx2"}
    proc = subprocess.run(child, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    if proc.returncode == BUILD_FAILED_ELSEWHERE:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = torch.load(out)
    native = every_check()
    assert got.keys() == native.keys()
    for name, want in native.items():
        assert torch.equal(got[name], want), name


def _avx2_child(out: Path) -> None:
    """The child: the AVX2 class's library built and loaded, every check run, outputs saved.
    Exits BUILD_FAILED_ELSEWHERE (a skip) where the library does not compile for the class
    because of other sources, named."""
    load_class_library("packed_rows.cpp")
    torch.save(every_check(), out)


if __name__ == "__main__":
    _avx2_child(Path(sys.argv[1]))
