"""neffkit's C++ kernel for integer weights times rows quantized to int8 per block of 32 inputs
(neffkit::int8_blocks, neffkit/platform/csrc/int8_blocks.cpp) against a float64 reference of
the same quantization (`int8_blocks.quantize_blocks`) and the weights' exact values: every path
the library and host have (AVX-512 VNNI, AVX2), 4- and 8-bit codes, the three kinds, group
sizes of 32 inputs to the whole row, row counts of every tile and its remainder, several
weights in one call, bf16 rows, an all-zero row and an all-zero block; the rows' quantization
bit for bit; and all of it again on the AVX2 class's build ($NEFFKIT_CPU_ISA=avx2, in a process
of its own: one library a process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from neffkit.kernels.int8_blocks import fake_quantized, quantize_blocks
from neffkit.kernels.intquant import pack_codes
from neffkit.platform import cpu_kernels, host, isa
from tests.support import REPO
from tests.support.cpu_class import BUILD_FAILED_ELSEWHERE, load_class_library

pytestmark = pytest.mark.skipif(
    not cpu_kernels.supported(), reason="needs a CPU class the kernels are written for"
)

PATHS = {"vnni": 1, "avx2": 0}
KINDS = {"sym": 0, "zero": 1, "min": 2}
# K: whole 64- and 128-byte vectors, a partial last one (96, 160), segments of every size
SIZES = (64, 96, 160, 576, 1536)
ROWS = (1, 2, 3, 5, 8, 9, 17, 64)  # every tile of both paths and their remainders
OUTPUTS = (21, 64, 3)  # weights in one call: tiles of 2 to 8 outputs and remainders
Weight = dict[str, torch.Tensor]


def groups(k: int) -> list[int]:
    """Group sizes (inputs a scale) that divide K: 32, 64, 128 and the whole row."""
    return sorted({g for g in (32, 64, 128, k) if k % g == 0})


def make_weight(n: int, k: int, bits: int, kind: int, group: int, seed: int) -> Weight:
    """Codes over their whole range, positive scales, zero points in the code range (kind 1,
    as float32), minimums about -s * 2^(bits-1) (kind 2)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // group, generator=gen) / 32 + 1e-3
    weight = {"codes": codes, "packed": pack_codes(codes, bits)[""], "scale": scale}
    if kind == 1:
        weight["aux"] = torch.randint(0, 1 << bits, scale.shape, generator=gen).float()
    elif kind == 2:
        weight["aux"] = -scale * (1 << (bits - 1)) * torch.rand(scale.shape, generator=gen)
    return weight


def values(w: Weight, kind: int, zero: int) -> torch.Tensor:
    """The weight's exact values in float64 [n, k]."""
    c = w["codes"].double()
    repeat = c.shape[1] // w["scale"].shape[1]
    s = w["scale"].double().repeat_interleave(repeat, -1)
    if kind == 0:
        return (c - zero) * s
    a = w["aux"].double().repeat_interleave(repeat, -1)
    return (c - a) * s if kind == 1 else c * s + a


def make_rows(count: int, k: int, seed: int) -> torch.Tensor:
    """Random rows of several magnitudes; row 1 all zeros, row 2 with an all-zero block and a
    block whose values quantize to halves (amax 127: scale 1, ties to even)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(count, k, generator=gen) * torch.rand(count, 1, generator=gen) * 4
    if count > 2:
        x[1] = 0
        x[2, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])
        x[2, 6:32] = x[2, 6:32].clamp(-100, 100)
        x[2, 32:64] = 0
    return x


def int8_blocks(x: torch.Tensor, ws: list[Weight], bits: int, kind: int, zero: int) -> torch.Tensor:
    aux = [w["aux"] for w in ws] if kind else [w["scale"] for w in ws]  # kind 0: any tensor
    return torch.ops.neffkit.int8_blocks(
        x, [w["packed"] for w in ws], [w["scale"] for w in ws], aux, bits, kind, zero
    )


def check(count: int, k: int, bits: int, kind: int, group: int, dtype: torch.dtype) -> None:
    """The kernel against the float64 sum of the quantized rows times the weight's values:
    within 1e-5 of the sum of the products' magnitudes (float32 rounding of a long sum)."""
    zero = (1 << (bits - 1)) if count % 2 else (3 if bits == 4 else 0)  # kind 0: zero
    seed = count * 1000 + k + 10 * bits + kind
    ws = [make_weight(n, k, bits, kind, group, seed + n) for n in OUTPUTS]
    x = make_rows(count, k, seed).to(dtype)
    got = int8_blocks(x, ws, bits, kind, zero)
    assert got.dtype == torch.float32 and got.shape == (count, sum(OUTPUTS))
    q, d = quantize_blocks(x)
    x_hat = (q.double() * d.double()).flatten(-2)
    w = torch.cat([values(w, kind, zero) for w in ws])
    want = x_hat @ w.t()
    bound = 1e-5 * (x_hat.abs() @ w.abs().t()) + 1e-30
    err = (got.double() - want).abs()
    case = dict(rows=count, k=k, bits=bits, kind=kind, group=group, zero=zero, dtype=dtype)
    assert bool((err <= bound).all()), (case, float((err / bound).max()))


def check_kind(bits: int, kind: int) -> int:
    """Every size, group size and row count of one kind on the path the library takes; bf16
    rows at a few row counts. The number of cases."""
    cases = 0
    for k in SIZES:
        for group in groups(k):
            for count in ROWS:
                check(count, k, bits, kind, group, torch.float32)
                cases += 1
                if count in (3, 9):
                    check(count, k, bits, kind, group, torch.bfloat16)
                    cases += 1
    return cases


def check_quantization() -> None:
    """Identity codes (8-bit, sym, zero 0, scale 1) read the quantized rows back: each output
    is one product q * d in float32, as `fake_quantized` computes it: bit for bit."""
    k = 576
    eye = torch.eye(k, dtype=torch.uint8)
    w = {"packed": eye, "scale": torch.ones(k, k // 32)}
    for dtype in (torch.float32, torch.bfloat16):
        x = make_rows(9, k, seed=1).to(dtype)
        q, d = quantize_blocks(x)
        assert torch.equal(int8_blocks(x, [w], 8, 0, 0), (q * d).flatten(-2)), dtype
    x = make_rows(9, k, seed=2)
    assert torch.equal(int8_blocks(x, [w], 8, 0, 0), fake_quantized(x))


def check_all() -> int:
    check_quantization()
    return sum(check_kind(bits, kind) for bits in (4, 8) for kind in KINDS.values())


def granted(path: str) -> bool:
    """Does this library (and CPU) take the path (int8_blocks_path grants at most the ask)?"""
    return torch.ops.neffkit.int8_blocks_path(PATHS[path]) == PATHS[path]


@pytest.fixture(scope="module")
def op():
    cpu_kernels.ensure_for_tracing()
    yield
    torch.ops.neffkit.int8_blocks_path(-1)


@pytest.fixture(params=list(PATHS))
def path(request, op):
    if not granted(request.param):
        pytest.skip(f"no {request.param} path in this library")
    yield request.param
    torch.ops.neffkit.int8_blocks_path(-1)


def test_the_best_path_is_the_host_s(op):
    vnni = "avx512_vnni" in host.cpu_flags() and isa.requested() == "native"
    assert torch.ops.neffkit.int8_blocks_path(-1) == (PATHS["vnni"] if vnni else PATHS["avx2"])


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("bits", [4, 8])
def test_int8_blocks_equal_the_float64_reference(path, bits, kind):
    check_kind(bits, KINDS[kind])


def test_the_rows_are_quantized_as_quantize_blocks_does_bit_for_bit(path):
    check_quantization()


def test_the_shape_function_gives_the_outputs_side_by_side(op):
    ws = [make_weight(n, 64, 4, 2, 32, seed=n) for n in (5, 7)]
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(3, 64))
        fake = [{key: mode.from_tensor(t) for key, t in w.items()} for w in ws]
        out = int8_blocks(x, fake, 4, 2, 0)
    assert out.shape == (3, 12) and out.dtype == torch.float32


def test_bad_inputs_are_refused(op):
    w = make_weight(4, 64, 8, 0, 32, seed=0)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        int8_blocks(torch.randn(2, 48), [w], 8, 0, 128)
    with pytest.raises(RuntimeError, match="codes must be uint8"):
        int8_blocks(x, [w], 4, 0, 8)  # 8-bit codes read as 4-bit
    with pytest.raises(RuntimeError, match="bits must be 4 or 8"):
        int8_blocks(x, [w], 6, 0, 32)
    with pytest.raises(RuntimeError, match="kind must be"):
        torch.ops.neffkit.int8_blocks(x, [w["packed"]], [w["scale"]], [w["scale"]], 8, 3, 0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        int8_blocks(x.double(), [w], 8, 0, 128)
    odd = {**w, "scale": torch.rand(4, 4)}  # groups of 16 inputs
    with pytest.raises(RuntimeError, match="scales must be float32"):
        int8_blocks(x, [odd], 8, 0, 128)
    with pytest.raises(RuntimeError, match="aux must be float32"):
        int8_blocks(x, [{**w, "aux": torch.rand(4, 1)}], 8, 1, 0)


def test_the_avx2_class_library_equals_the_reference():
    """Every check above on the library built for the AVX2 class (-march=x86-64-v3: no
    AVX-512, the VPMADDUBSW path) in one child process."""
    if isa.requested() == "avx2":
        pytest.skip("this process builds for the AVX2 class: the tests above check it")
    env = {**os.environ, isa.ENV: "avx2"}
    child = [sys.executable, "-m", "tests.e2e.test_int8_blocks"]
    proc = subprocess.run(child, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    if proc.returncode == BUILD_FAILED_ELSEWHERE:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"path 0 cases \d+", proc.stdout), proc.stdout[-1000:]


def _avx2_child() -> None:
    """The child: the AVX2 class's library built and loaded, every check run. Exits
    BUILD_FAILED_ELSEWHERE (a skip) where the library does not compile for the class because
    of other sources, named."""
    load_class_library("int8_blocks.cpp")
    best = torch.ops.neffkit.int8_blocks_path(-1)
    print(f"path {best} cases {check_all()}")


if __name__ == "__main__":
    _avx2_child()
