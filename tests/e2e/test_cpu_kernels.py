"""neffkit's C++ projection kernel (neffkit/platform/csrc/blocked_rows.cpp) against torch's
matmul, and its way into a bundle: built at `neffkit build`, shipped in kernels/, loaded by
the runtime from there (no compiler on the serving host). The kernels compiled for the AVX2
class ($NEFFKIT_CPU_ISA=avx2) run in a process of their own (`test_avx2_class_...`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from neffkit.models.projection import to_blocked
from neffkit.platform import cpu_kernels, host
from tests.support import REPO
from tests.support.cli import bundle_json

pytestmark = pytest.mark.skipif(not cpu_kernels.supported(), reason="needs AVX-512")


@pytest.fixture(scope="module")
def op():
    cpu_kernels.ensure_for_tracing()
    return lambda x, w: torch.ops.neffkit.blocked_rows(x, [w])  # one weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 37])
def test_blocked_rows_equals_matmul(op, dtype, rows):
    """Every row count (tiles of 8, 4 and 2 blocks, and their remainders: 13 blocks; 37: a
    prefill's tokens, four groups of 8 and one of 5), both
    weight dtypes (bf16 widened in-register), over K steps past the prefetch distance."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(13 * 16, 96, generator=gen).to(dtype)
    x = torch.randn(rows, 96, generator=gen)
    got = op(x, to_blocked(weight, 16))
    want = x.float() @ weight.float().t()
    assert got.dtype == torch.float32 and got.shape == (rows, 13 * 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.fixture(params=["amx", "dot", "fma"])
def amx(request, op):
    """Every path of bf16 rows: AMX tiles, VDPBF16PS pairs (each where the host has it) and the
    widened FMA."""
    torch.ops.neffkit.set_amx(request.param == "amx")
    torch.ops.neffkit.set_bf16_dot(int(request.param == "dot"))
    yield request.param
    torch.ops.neffkit.set_amx(True)
    torch.ops.neffkit.set_bf16_dot(-1)


def test_bf16_dot_is_used_where_the_cpu_has_it(op):
    assert torch.ops.neffkit.set_bf16_dot(1) == ("avx512_bf16" in host.cpu_flags())
    assert torch.ops.neffkit.set_bf16_dot(0) is False
    torch.ops.neffkit.set_bf16_dot(-1)


def test_amx_is_used_where_the_cpu_has_it(op):
    assert torch.ops.neffkit.set_amx(True) == ({"amx_tile", "amx_bf16"} <= host.cpu_flags())
    assert torch.ops.neffkit.set_amx(False) is False
    torch.ops.neffkit.set_amx(True)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16, 17, 37])
def test_bf16_rows_on_bf16_weights(op, amx, rows):
    """bf16 x bf16 products are exact in float32 on either path; only the summation order
    differs. 17 rows: two tile row groups; K = 160: five 32-wide chunks, odd and even tiles."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(5 * 16, 160, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 160, generator=gen).to(torch.bfloat16)
    want = x.float() @ weight.float().t()
    torch.testing.assert_close(op(x, to_blocked(weight, 16)), want, rtol=1e-5, atol=1e-4)


def test_blocked_rows_odd_width_and_bf16_rows(op):
    """An odd K, and bf16 rows (converted to float32 by the kernel)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 33, generator=gen).to(torch.bfloat16)
    for x in (torch.randn(3, 33, generator=gen), torch.randn(3, 33, generator=gen).bfloat16()):
        want = x.float() @ weight.float().t()
        torch.testing.assert_close(op(x, to_blocked(weight, 16)), want, rtol=1e-5, atol=1e-4)


def test_bundle_ships_the_kernel_and_the_runtime_needs_no_compiler(bundle, tmp_path):
    """llama_tied is built with cpu_kernel: on: every graph records the kernel form and
    the library travels in kernels/; a run with no compiler and an empty kernel cache loads it
    from there (its HF parity is test_runtime's)."""
    path = bundle("llama_tied")
    data = bundle_json(path)
    assert data["kernels"] == ["kernels/libneffkit_cpu.so"]
    assert "kernels/libneffkit_cpu.so" in data["files"]
    forms = {g["name"]: g["projection"] for g in data["graphs"]}
    assert set(forms.values()) == {"kernel-rows"}  # prefill's tokens too
    env = {**os.environ, "CXX": "/nonexistent/g++", "NEFFKIT_KERNEL_CACHE": str(tmp_path)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "neffkit",
            "run",
            str(path),
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(json.loads(proc.stdout)["outputs"][0]["token_ids"]) == 4
    assert list(tmp_path.iterdir()) == []  # nothing compiled


# an AOTInductor compile on every run: `make test-all`; `make test` compiles the form in the qwen3
# bundle (cpu_kernel: off) and checks it against HF
@pytest.mark.full
def test_blocked_projection_compiles_with_weights_as_inputs(tmp_path) -> None:
    """The blocked-rows form through AOTInductor, the weight a graph input: x @ W.T."""
    from torch._inductor import aoti_compile_and_package, aoti_load_package

    from neffkit.models.forms import LANES, ProjectionPolicy
    from neffkit.models.projection import project, to_blocked

    policy = ProjectionPolicy(max_rows=8, lanes=LANES)

    class Proj(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return project(x, w, policy)

    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 96, generator=gen), torch.randn(4, 96, generator=gen)
    blocked = to_blocked(weight, LANES)
    program = torch.export.export(Proj(), (x, blocked))
    package = aoti_compile_and_package(program, package_path=str(tmp_path / "proj.pt2"))
    out = aoti_load_package(package)(x, blocked)
    torch.testing.assert_close(out, x @ weight.t(), atol=1e-5, rtol=1e-5)


# as above; `make test` compiles the op's calls in the tied llama bundle (cpu_kernel: on)
@pytest.mark.full
def test_projections_of_one_input_compile_as_one_kernel_call(tmp_path, op) -> None:
    """project_many through AOTInductor: three weights (graph inputs), one call of the op with a
    list of them, each output x @ W.T."""
    from torch._inductor import aoti_compile_and_package, aoti_load_package

    from neffkit.models.forms import LANES, ProjectionPolicy
    from neffkit.models.projection import project_many, to_blocked

    policy = ProjectionPolicy(max_rows=8, lanes=LANES, kernel="on")

    class Qkv(torch.nn.Module):
        def forward(self, x: torch.Tensor, *ws: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(project_many(x, list(ws), policy))

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, 96, generator=gen) for n in (64, 32, 32)]
    x = torch.randn(2, 96, generator=gen)
    blocked = [to_blocked(w, LANES) for w in weights]
    program = torch.export.export(Qkv(), (x, *blocked))
    calls = [n for n in program.graph.nodes if n.target == torch.ops.neffkit.blocked_rows.default]
    assert len(calls) == 1
    package = aoti_compile_and_package(program, package_path=str(tmp_path / "qkv.pt2"))
    outs = aoti_load_package(package)(x, *blocked)
    for out, weight in zip(outs, weights, strict=True):
        torch.testing.assert_close(out, x @ weight.t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "fp8"])
def test_weights_of_one_input_in_one_call_equal_each_alone(op, kind, rows):
    """q/k/v and gate/up go as one call (one parallel region): each weight's outputs, side by
    side, equal its own call's bit for bit, whatever block of which weight a thread starts in
    (13, 1, 6 and 40 blocks: tile remainders in every weight)."""
    from neffkit.kernels.quant import lane_scales, quantize_blocks

    gen = torch.Generator().manual_seed(rows)
    plain = [torch.randn(blocks * 16, 96, generator=gen) for blocks in (13, 1, 6, 40)]
    x = torch.randn(rows, 96, generator=gen)
    if kind == "fp8":
        quantized = [quantize_blocks(w, (32, 32)) for w in plain]
        ws = [to_blocked(q, 16) for q, _ in quantized]
        scales = [lane_scales(g, tuple(q.shape), (32, 32), 16) for q, g in quantized]
        for x_rows in (x, x.bfloat16()):
            alone = [
                torch.ops.neffkit.blocked_rows_fp8(x_rows, [w], [s], 32)
                for w, s in zip(ws, scales, strict=True)
            ]
            together = torch.ops.neffkit.blocked_rows_fp8(x_rows, ws, scales, 32)
            assert torch.equal(together, torch.cat(alone, -1))
        return
    dtype = getattr(torch, kind)
    ws = [to_blocked(w.to(dtype), 16) for w in plain]
    x = x.to(dtype)
    together = torch.ops.neffkit.blocked_rows(x, ws)
    assert together.shape == (rows, 60 * 16)
    assert torch.equal(together, torch.cat([op(x, w) for w in ws], -1))
    with pytest.raises(RuntimeError, match="disagree on K"):
        torch.ops.neffkit.blocked_rows(x, [ws[0], to_blocked(torch.randn(16, 64).to(dtype), 16)])


@pytest.fixture(params=["float32", "bf16-dot", "bf16-fma"])
def fp8_rows(request, op):
    """The rows' dtype and path of the fp8 kernel: float32 rows (widened FMA), bf16 rows through
    VDPBF16PS (where the CPU has AVX512-BF16), bf16 rows widened to float32."""
    if request.param == "bf16-dot" and not torch.ops.neffkit.set_bf16_dot(1):
        pytest.skip("no avx512_bf16 here")
    torch.ops.neffkit.set_bf16_dot(int(request.param == "bf16-dot"))
    yield request.param
    torch.ops.neffkit.set_bf16_dot(-1)


def _flushed(weight: torch.Tensor, path: str) -> torch.Tensor:
    """The e4m3 values a path reads: VDPBF16PS reads the subnormals (exponent 0) as 0."""
    values = weight.float()
    if path == "bf16-dot":
        return torch.where(weight.view(torch.uint8) & 0x78 == 0, 0.0, values)
    return values


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11])
@pytest.mark.parametrize("block", [(16, 16), (128, 64), (1, 0), (0, 0)])
def test_blocked_rows_fp8_equals_the_dequantized_matmul(rows, block, fp8_rows):
    """The fp8 path: e4m3 bytes widened in register, scaled per (partial) K block by
    `lane_scales`, for fine-grained blocks, per-channel and per-tensor scales."""
    from neffkit.kernels.quant import expand_scales, lane_scales, scale_grid

    gen = torch.Generator().manual_seed(rows)
    out_features, in_features = 256, 200  # 200: the last K block of 16 and 64 is partial
    weight = (torch.randn(out_features, in_features, generator=gen) * 64).to(torch.float8_e4m3fn)
    shape = (out_features, in_features)
    grid = torch.rand(scale_grid(shape, block), generator=gen) + 0.5
    exact = _flushed(weight, fp8_rows).double() * expand_scales(grid, shape, block).double()
    k_block = block[1] or in_features
    x = torch.randn(rows, in_features, generator=gen)
    x = x if fp8_rows == "float32" else x.bfloat16()
    got = torch.ops.neffkit.blocked_rows_fp8(
        x, [to_blocked(weight, 16)], [lane_scales(grid, shape, block, 16)], k_block
    )
    want = x.double() @ exact.t()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


def test_fp8_widening_is_exact_for_every_byte(fp8_rows):
    """All 256 e4m3fn encodings, subnormals and signed zeros included, read back exactly (the
    two NaN bytes, never in a checkpoint's weights, read as +-480; through VDPBF16PS the
    subnormals read as 0)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    weight = torch.zeros(1, 256, 16, dtype=torch.float8_e4m3fn)
    weight[0, :, 3] = values
    eye = torch.eye(256) if fp8_rows == "float32" else torch.eye(256).bfloat16()
    got = torch.ops.neffkit.blocked_rows_fp8(eye, [weight], [torch.ones(1, 1, 16)], 256)
    finite = ~values.float().isnan()
    want = _flushed(values, fp8_rows)
    assert torch.equal(got[finite, 3], want[finite])
    assert got[~finite, 3].tolist() == [480.0, -480.0]
    assert not got[:, [0, 1, 2, 4]].any()


# ---- the AVX2 class: the library compiled for -march=x86-64-v3 (two ymm a 16-lane vector, its
# own tile widths), loaded in a child process (one library a process; this module run as a script)
Case = tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor], float]  # call, want, tol


def _projection_cases(gen: torch.Generator) -> dict[str, Case]:
    """blocked_rows: 3 weights a call, float32/bf16 weights and rows, an odd K, 1..37 rows."""
    cases: dict[str, Case] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for k in (96, 33):
            plain = torch.randn(20 * 16, k, generator=gen).to(dtype)
            ws = [to_blocked(w, 16) for w in plain.split([13 * 16, 16, 6 * 16])]
            for rows in (*range(1, 10), 11, 16, 17, 37):
                for x_dtype in dict.fromkeys((torch.float32, dtype)):
                    x = torch.randn(rows, k, generator=gen).to(x_dtype)
                    cases[f"rows {dtype} K={k} {rows} {x_dtype}"] = (
                        lambda x=x, ws=ws: torch.ops.neffkit.blocked_rows(x, ws),
                        lambda x=x, plain=plain: x.float() @ plain.float().t(),
                        1e-5,
                    )
    return cases


def _fp8_cases(gen: torch.Generator) -> dict[str, Case]:
    """blocked_rows_fp8: K blocks, per channel, float32/bf16 rows; every e4m3 byte exactly."""
    from neffkit.kernels.quant import expand_scales, lane_scales, scale_grid

    cases: dict[str, Case] = {}
    shape = (256, 200)
    for block in ((16, 16), (128, 64), (0, 0)):
        weight = (torch.randn(shape, generator=gen) * 64).to(torch.float8_e4m3fn)
        grid = torch.rand(scale_grid(shape, block), generator=gen) + 0.5
        exact = weight.double() * expand_scales(grid, shape, block).double()
        args = ([to_blocked(weight, 16)], [lane_scales(grid, shape, block, 16)], block[1] or 200)
        for rows in (1, 2, 5, 8, 11):
            x = torch.randn(rows, shape[1], generator=gen)
            for xr in (x, x.bfloat16()):
                cases[f"fp8 {block} {rows} {xr.dtype}"] = (
                    lambda xr=xr, args=args: torch.ops.neffkit.blocked_rows_fp8(xr, *args),
                    lambda xr=xr, exact=exact: (xr.double() @ exact.t()).float(),
                    1e-5,
                )
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    weight = torch.zeros(1, 256, 16, dtype=torch.float8_e4m3fn)
    weight[0, :, 3], want = values, torch.zeros(256, 16)
    want[:, 3] = torch.nan_to_num(values.float(), nan=480.0).index_fill(0, torch.tensor(255), -480)
    every_byte = ([weight], [torch.ones(1, 1, 16)], 256)
    fp8 = torch.ops.neffkit.blocked_rows_fp8
    cases["fp8 every byte"] = (lambda: fp8(torch.eye(256), *every_byte), lambda: want, 0.0)
    return cases


def _attention_cases(gen: torch.Generator) -> dict[str, Case]:
    """paged_decode_attention on test_decode_attention's cases and its reference (the graph's
    form, float32; the padding row's output zeros)."""
    from neffkit.kernels.attention import visible_from
    from tests.e2e.test_decode_attention import _case, _reference

    cases: dict[str, Case] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for heads, kv_heads, dim, dim_v in ((6, 2, 64, 64), (3, 1, 16, 40), (4, 4, 24, 24)):
            q, k_cache, v_cache, tables, lens, positions = _case(dtype, heads, kv_heads, dim, dim_v)
            for variant in ("plain", "window", "sinks", "softcap"):
                window = 5 if variant == "window" else None
                sinks = torch.randn(heads, generator=gen).to(dtype) if variant == "sinks" else None
                softcap = 2.0 if variant == "softcap" else None
                lo = visible_from(positions[:, 0], window, None)
                hi = torch.minimum(positions[:, 0], lens - 1)
                args = (q[:, 0], k_cache, v_cache, tables, lo, hi, sinks, 0.3, softcap or 0.0)
                wide = [t.float() if t is not None else None for t in (q, k_cache, v_cache, sinks)]
                ref = (*wide[:3], tables, lens, positions, window, wide[3], softcap)
                cases[f"attention {dtype} {heads} {kv_heads} {dim} {dim_v} {variant}"] = (
                    lambda args=args: torch.ops.neffkit.paged_decode_attention(*args).float(),
                    lambda ref=ref: _reference(*ref).index_fill(0, torch.tensor(3), 0.0),
                    1e-5 if dtype == torch.float32 else 8e-3,  # bf16: the output's rounding
                )
    return cases


def _class_cases() -> dict[str, Case]:
    """Every kernel's cases, seeded: the same inputs in every process."""
    gen = torch.Generator().manual_seed(0)
    return {**_projection_cases(gen), **_fp8_cases(gen), **_attention_cases(gen)}


def _run_avx2_class(out: Path) -> None:
    """The child: the AVX2 class's library built and loaded; every case's output saved."""
    cpu_kernels.load_library(cpu_kernels.build_library())
    got = {name: call() for name, (call, _, _) in _class_cases().items()}
    paths = [torch.ops.neffkit.set_amx(True), torch.ops.neffkit.set_bf16_dot(1)]
    torch.save({**got, "amx, vdpbf16ps": torch.tensor(paths)}, out)


def test_avx2_class_equals_torch_and_the_native_fma_paths(op, tmp_path):
    """The AVX2 class's kernels against torch's references, and bit for bit against this
    build's FMA paths (AMX and VDPBF16PS off): the same products in the same order. Neither
    AMX nor VDPBF16PS is in the AVX2 class's library."""
    out = tmp_path / "avx2.pt"
    child = [sys.executable, "-m", "tests.e2e.test_cpu_kernels", str(out)]
    env = {**os.environ, "NEFFKIT_CPU_ISA": "avx2"}
    proc = subprocess.run(child, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    assert got.pop("amx, vdpbf16ps").tolist() == [False, False]
    cases = _class_cases()
    torch.ops.neffkit.set_amx(False)
    torch.ops.neffkit.set_bf16_dot(0)
    try:
        native = {name: call() for name, (call, _, _) in cases.items()}
    finally:
        torch.ops.neffkit.set_amx(True)
        torch.ops.neffkit.set_bf16_dot(-1)
    for name, (_, want, tol) in cases.items():
        expected = want()
        atol = tol * max(1.0, expected.abs().max().item())
        torch.testing.assert_close(got[name], expected, rtol=tol, atol=atol, msg=name)
        assert torch.equal(got[name], native[name]), name


if __name__ == "__main__":
    _run_avx2_class(Path(sys.argv[1]))
