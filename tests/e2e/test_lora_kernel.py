"""neffkit::lora_rows (csrc/lora_rows.cpp) against the graph's own form (kernels/lora.py): each
row through its slot's A and B, the base's rows zero, slots out of range clamped; float32 and
bf16, ranks with and without a 16-lane tail, widths with and without a partial block, inputs
in one chunk or split between threads, more adapted rows than one pass carries."""

from __future__ import annotations

import pytest
import torch

from neffkit.kernels.lora import lora_delta, lora_rows, slot_mask
from neffkit.platform import cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def library() -> None:
    if not cpu_kernels.supported():
        pytest.skip("no kernel class for this CPU")
    cpu_kernels.ensure_for_tracing()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 16, 32])
@pytest.mark.parametrize("n_in", [96, 200])
def test_lora_rows_equals_the_masked_form(dtype, rank, n_in):
    gen = torch.Generator().manual_seed(rank)
    loras, outs = 3, (64, 200, 16)
    x = torch.randn(3, 4, n_in, generator=gen).to(dtype)  # 3 sequences of 4 tokens (verify)
    pairs = [
        (
            (torch.randn(n_in, loras, rank, generator=gen) * 0.1).to(dtype),
            (torch.randn(loras, rank, out, generator=gen) * 0.1).to(dtype),
        )
        for out in outs
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # 200 inputs: two chunks, each thread's partial sums added up
    try:
        check_rows(x, pairs, loras)
    finally:
        torch.set_num_threads(threads)


def check_rows(x: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]], loras: int) -> None:
    dtype = x.dtype
    for row_slots in ([0, 2, 1], [3, 3, 3], [1, 9, 2], [-4, 0, 0]):  # 9, -4: clamped to 3, 0
        seq = torch.tensor(row_slots)
        tokens = seq.clamp(0, loras).unsqueeze(1).expand(-1, 4).reshape(-1)
        got = lora_rows(x, pairs, tokens)
        mask = slot_mask(seq, None, loras, torch.float32)
        for (a, b), delta in zip(pairs, got, strict=True):
            want = lora_delta(x.float(), a.float(), b.float(), mask)
            assert delta.dtype == dtype and delta.shape == want.shape
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(delta.float(), want, atol=tol, rtol=tol)
            base_rows = seq.clamp(0, loras) == 0
            assert not delta[base_rows].any()  # the base: exactly zero


def test_lora_rows_refuses_shapes_that_disagree():
    x = torch.randn(2, 32)
    a, b = torch.randn(32, 2, 16), torch.randn(2, 16, 48)
    with pytest.raises(RuntimeError, match="shapes do not agree"):
        torch.ops.neffkit.lora_rows(x, [a], [torch.randn(2, 8, 48)], torch.tensor([1, 0]))
    with pytest.raises(RuntimeError, match="slots must be int64"):
        torch.ops.neffkit.lora_rows(x, [a], [b], torch.tensor([1.0, 0.0]))
