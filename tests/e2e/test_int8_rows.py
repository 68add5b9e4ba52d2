"""neffkit's C++ kernel for W8A8 projections (neffkit::int8_rows, neffkit/platform/csrc/
int8_rows.cpp) against the graph's form (`intquant.project_w8a8`) bit for bit wherever that
one's float32 sums are exact, and against an int64 numpy reference of the same quantization for
any K: every path the host has (AMX tiles, AVX-512 VNNI, AVX2), every row count the tiles split
into, several weights in one call, bf16 rows, all-zero rows, and the AVX2 class's build."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from neffkit.kernels.intquant import (
    SCALE,
    Int8Activations,
    QuantScheme,
    int8_kernel_reads,
    project_w8a8,
)
from neffkit.models.forms import ProjectionPolicy
from neffkit.models.projection import project, project_many
from neffkit.platform import cpu_kernels, host
from tests.support import REPO

W8A8 = QuantScheme("sym", 8, 0, zero=128, activations="int8-token")
KERNEL = ProjectionPolicy(max_rows=8, lanes=16, kernel="auto")
GRAPH = ProjectionPolicy(max_rows=8, lanes=16)  # kernel "off": project_w8a8
PATHS = {"amx": 2, "vnni": 1, "avx2": 0}
# outputs of several weights in one call: tiles of 64/16 outputs and every remainder
OUTPUTS = (48, 16, 21, 64)
ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 37)
# K: whole 64-byte steps, tails of 8, 16 and 1 values, the largest exact in float32 (1040)
EXACT_K = (64, 200, 576, 1040, 1537)


def weights(outputs: tuple[int, ...], k: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Codes over the whole byte (q from -128 to 127) and a scale per output channel."""
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "": torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen),
            SCALE: torch.rand(n, 1, generator=gen) / 64,
        }
        for n in outputs
    ]


def rows(count: int, k: int, seed: int) -> torch.Tensor:
    """Random rows, row 1 all zeros (scale 1), row 2 with values that quantize to halves."""
    x = torch.randn(count, k, generator=torch.Generator().manual_seed(seed))
    if count > 2:
        x[1] = 0
        x[2, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])  # scale 1: ties to even
        x[2, 6:] = x[2, 6:].clamp(-100, 100)
    return x


def reference(x: torch.Tensor, ws: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """vLLM's per-token int8 and epilogue in numpy, the dot products in int64."""
    xf = x.float().numpy()
    amax = np.abs(xf).max(-1, keepdims=True)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.clip(np.rint(xf * inverse), -127, 127).astype(np.int64)
    x_scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    out = []
    for w in ws:
        acc = (q @ (w[""].numpy().astype(np.int64) - 128).T).astype(np.float32)
        out.append(x_scale * (w[SCALE].numpy().reshape(-1) * acc))
    return torch.from_numpy(np.concatenate(out, -1))


def graph_form(x: torch.Tensor, ws: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([project_w8a8(x.float(), Int8Activations(w, W8A8)) for w in ws], -1)


def int8_rows(x: torch.Tensor, ws: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    return torch.ops.neffkit.int8_rows(x, [w[""] for w in ws], [w[SCALE] for w in ws])


def check(k: int, count: int, dtype: torch.dtype) -> None:
    ws = weights(OUTPUTS, k, seed=k + count)
    x = rows(count, k, seed=count).to(dtype)
    got = int8_rows(x, ws)
    assert got.dtype == torch.float32 and got.shape == (count, sum(OUTPUTS))
    assert torch.equal(got, reference(x, ws)), (k, count, dtype)
    if k <= 1040:  # 127 * 127 * K < 2^24: the graph's float32 sums are exact
        assert torch.equal(got, graph_form(x, ws)), (k, count, dtype)


def check_all() -> int:
    """Every case on the path the library takes; the number of cases."""
    cases = 0
    for k in (*EXACT_K, 4096):
        for count in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                check(k, count, dtype)
                cases += 1
    return cases


@pytest.fixture(scope="module")
def op():
    if not cpu_kernels.supported():
        pytest.skip("the kernel library is not built for this CPU class")
    cpu_kernels.ensure_for_tracing()
    yield
    torch.ops.neffkit.int8_rows_path(-1)


def host_paths() -> set[str]:
    flags = host.cpu_flags()
    out = {"avx2"}
    if "avx512_vnni" in flags:
        out.add("vnni")
    if {"amx_tile", "amx_int8"} <= flags:
        out.add("amx")
    return out


@pytest.fixture(params=list(PATHS))
def path(request, op):
    if request.param not in host_paths():
        pytest.skip(f"no {request.param} on this host")
    assert torch.ops.neffkit.int8_rows_path(PATHS[request.param]) == PATHS[request.param]
    yield request.param
    torch.ops.neffkit.int8_rows_path(-1)


def test_the_best_path_is_the_host_s(op):
    best = max(PATHS[p] for p in host_paths())
    assert torch.ops.neffkit.int8_rows_path(-1) == best


@pytest.mark.parametrize("k", EXACT_K)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_rows_equal_the_graph_form_bit_for_bit(path, k, dtype):
    for count in ROWS:
        check(k, count, dtype)


@pytest.mark.parametrize("k", [4096, 8192 + 24])
def test_long_rows_equal_the_integer_reference(path, k):
    """Beyond 127 * 128 * K < 2^24 the graph's float32 sums round; the kernel's int32 do not."""
    for count in (1, 5, 16):
        ws = weights((40, 32), k, seed=count)
        x = rows(count, k, seed=count)
        assert torch.equal(int8_rows(x, ws), reference(x, ws)), count


def test_weights_of_one_input_in_one_call_equal_each_alone(op):
    ws = weights(OUTPUTS, 576, seed=3)
    x = rows(9, 576, seed=3)
    alone = torch.cat([int8_rows(x, [w]) for w in ws], -1)
    assert torch.equal(int8_rows(x, ws), alone)


def test_bad_shapes_are_refused(op):
    (w,) = weights((16,), 64, seed=0)
    with pytest.raises(RuntimeError, match=r"codes must be uint8 \[N, K\]"):
        int8_rows(torch.randn(2, 32), [w])
    with pytest.raises(RuntimeError, match="scales must be float32"):
        torch.ops.neffkit.int8_rows(torch.randn(2, 64), [w[""]], [w[SCALE][:8]])
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        int8_rows(torch.randn(2, 64, dtype=torch.float64), [w])


@pytest.mark.parametrize("count", [1, 8, 16])
def test_the_kernel_form_equals_the_graph_form(op, count):
    """Where the kernel library is in use W8A8 projections take it, one call for q/k/v, with
    the graph form's results bit for bit (bf16 rows: its cast of the same float32 values)."""
    assert KERNEL.int8_form(count) == "kernel-int8" and GRAPH.int8_form(count) == "mm"
    ws = [Int8Activations(w, W8A8) for w in weights((64, 32, 32), 256, seed=count)]
    assert all(int8_kernel_reads(w) for w in ws)
    for dtype in (torch.float32, torch.bfloat16):
        x = rows(count, 256, seed=count).to(dtype).unsqueeze(1)
        got, want = project_many(x, ws, KERNEL), project_many(x, ws, GRAPH)
        for g, w, weight in zip(got, want, ws, strict=True):
            assert g.shape == (count, 1, weight.out_features) and g.dtype == dtype
            assert torch.equal(g, w)
        assert torch.equal(project(x, ws[0], KERNEL), got[0])


def test_the_avx2_class_library_equals_the_references():
    """The library built for the AVX2 class (-march=x86-64-v3: no AVX-512, so the VPMADDUBSW
    path) in one subprocess: every case of `check_all`."""
    env = {**os.environ, "NEFFKIT_CPU_ISA": "avx2"}
    code = "from tests.e2e.test_int8_rows import avx2_class_main; avx2_class_main()"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env
    )
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "paths 0 cases" in proc.stdout


def avx2_class_main() -> None:
    """The subprocess of the AVX2 class test: build and load the library, run every case.
    Exit 3 (a skip) where the library does not compile for the class because of another
    source, named."""
    try:
        path = cpu_kernels.build_library()
    except cpu_kernels.KernelBuildError as exc:
        failing = re.findall(r"csrc/(\w+\.(?:cpp|h)):\d+", str(exc))
        if failing and "int8_rows.cpp" not in failing:
            print(f"the avx2 library does not compile yet: {failing[0]} (not int8_rows.cpp)")
            sys.exit(3)
        raise
    cpu_kernels.load_library(path)
    best = torch.ops.neffkit.int8_rows_path(-1)
    print(f"paths {best} cases {check_all()}")
