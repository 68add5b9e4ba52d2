"""neffkit::lora_rows (csrc/lora_rows.cpp) against the graph's own form (kernels/lora.py): each
row through its slot's A and B, the base's rows zero, slots out of range clamped; float32 and
bf16, ranks with and without a 16-lane tail, widths with and without a partial block."""

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
def test_lora_rows_equals_the_masked_form(dtype, rank):
    gen = torch.Generator().manual_seed(rank)
    loras, n_in, outs = 3, 96, (64, 200, 16)
    x = torch.randn(2, 4, n_in, generator=gen).to(dtype)  # 2 sequences of 4 tokens (verify)
    pairs = [
        (
            (torch.randn(n_in, loras, rank, generator=gen) * 0.1).to(dtype),
            (torch.randn(loras, rank, out, generator=gen) * 0.1).to(dtype),
        )
        for out in outs
    ]
    for row_slots in ([0, 2], [3, 3], [1, 9], [-4, 0]):  # 9 and -4: clamped to 3 and 0
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
