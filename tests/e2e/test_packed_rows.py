"""neffkit's C++ kernel for decode rows on 4-bit weights at their width (neffkit::packed_rows,
neffkit/platform/csrc/packed_rows.cpp) against `dequantize`: every weight value bit for bit,
every 4-bit kind, group size and row count, and the projection forms that call it."""

from __future__ import annotations

import pytest
import torch

from neffkit.kernels.intquant import SCALE, PackedWeight, QuantScheme, dequantize, kernel_table
from neffkit.models.forms import ProjectionPolicy
from neffkit.models.projection import kernel_reads, project_many, project_packed
from neffkit.platform import cpu_kernels
from tests.unit.test_packed_projection import stored_parts

pytestmark = pytest.mark.skipif(not cpu_kernels.supported(), reason="needs AVX-512")

KERNEL = ProjectionPolicy(max_rows=8, lanes=16, kernel="auto")
INDUCTOR = ProjectionPolicy(max_rows=8, lanes=16)  # kernel "off": the packed-rows form
SCHEMES = [
    QuantScheme("sym", 4, 32, zero=8),
    QuantScheme("sym", 4, 0, zero=8),
    QuantScheme("zero", 4, 64),
    QuantScheme("min", 4, 32),
    QuantScheme("e2m1", 4, 32),
]


@pytest.fixture(scope="module")
def op():
    cpu_kernels.ensure_for_tracing()

    def call(x: torch.Tensor, weights: list[dict], scheme: QuantScheme) -> torch.Tensor:
        base, mode = kernel_table(scheme, x.device)
        scales = [w[SCALE] for w in weights]
        aux = [w[scheme.aux] for w in weights] if scheme.aux else scales
        return torch.ops.neffkit.packed_rows(x, [w[""] for w in weights], scales, aux, base, mode)

    return call


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.to_id())
def test_every_weight_value_is_dequantize_s_bit_for_bit(op, scheme):
    """One-hot rows pick single weight values out of the sums (x 1.0, plus zeros: exact)."""
    parts = stored_parts(scheme, 40, 128, seed=1)
    want = dequantize(parts, scheme, torch.float32)  # [40, 128]
    eye = torch.eye(128)
    for r0 in range(0, 128, 8):
        got = op(eye[r0 : r0 + 8], [parts], scheme)  # [8, 40]: columns r0 .. r0+7 of W
        assert torch.equal(got, want[:, r0 : r0 + 8].t()), r0


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.to_id())
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_packed_rows_equal_the_widened_matmul(op, scheme, rows):
    """Every row count (4, 2 and 1 output rows side by side, and the remainders of 37)."""
    parts = stored_parts(scheme, 37, 192, seed=rows)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    got = op(x, [parts], scheme)
    want = x @ dequantize(parts, scheme, torch.float32).t()
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_weights_of_one_input_in_one_call_equal_each_alone(op):
    scheme = QuantScheme("sym", 4, 32, zero=8)
    weights = [stored_parts(scheme, n, 96, seed=n) for n in (48, 16, 21)]
    x = torch.randn(3, 96)
    together = op(x, weights, scheme)
    alone = torch.cat([op(x, [w], scheme) for w in weights], dim=-1)
    assert torch.equal(together, alone)


def test_layouts_the_kernel_does_not_read_are_refused_by_it(op):
    scheme = QuantScheme("sym", 4, 16, zero=8)  # a group of 8 code bytes
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.randn(1, 64), [stored_parts(scheme, 4, 64)], scheme)
    assert not kernel_reads(PackedWeight(stored_parts(scheme, 4, 64), scheme, torch.float32))
    eight = QuantScheme("sym", 8, 0, zero=128)
    assert not kernel_reads(PackedWeight(stored_parts(eight, 4, 64), eight, torch.float32))
    sym4 = QuantScheme("sym", 4, 32, zero=8)
    bf16 = PackedWeight(stored_parts(sym4, 4, 64), sym4, torch.bfloat16)
    assert not kernel_reads(bf16)  # bf16 values: the twin's rounding, not the kernel's


@pytest.mark.parametrize("rows", [1, 4, 9])
def test_the_kernel_form_equals_inductor_s_form(op, rows):
    """Up to max_rows rows the kernel form (q/k/v in one call); beyond, both widen to `mm`."""
    scheme = QuantScheme("zero", 4, 64)
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
