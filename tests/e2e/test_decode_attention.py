"""neffkit's C++ decode attention (neffkit/platform/csrc/decode_attention.cpp) against the graph's
own form: the context gathered through the block table, masked, and `paged_attention`."""

from __future__ import annotations

import pytest
import torch

from neffkit.kernels.attention import (
    context_mask,
    kernel_attention,
    packed_context_mask,
    packed_visible_keys,
    paged_attention,
    visible_from,
)
from neffkit.kernels.kv import gather_context
from neffkit.platform import cpu_kernels
from tests.support.cli import bundle_json

pytestmark = pytest.mark.skipif(not cpu_kernels.supported(), reason="needs AVX-512")

BLOCK = 8


@pytest.fixture(scope="module")
def op():
    cpu_kernels.ensure_for_tracing()
    return torch.ops.neffkit.paged_decode_attention


def _case(dtype, heads, kv_heads, dim, dim_v, seed=0):
    """Four rows over shuffled blocks of a 32-slot context: full, short, one key, padding."""
    gen = torch.Generator().manual_seed(seed)
    rows, blocks_per_row, num_blocks = 4, 4, 20
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim_v, generator=gen).to(dtype)
    q = (torch.randn(rows, 1, heads, dim, generator=gen) * 2).to(dtype)
    tables = torch.randperm(num_blocks - 1, generator=gen)[: rows * blocks_per_row] + 1
    tables = tables.reshape(rows, blocks_per_row)
    context_lens = torch.tensor([32, 13, 1, 0])
    tables[1, 2:] = -1  # past the row's valid blocks, as the host fills them
    tables[3] = -1
    positions = (context_lens - 1).clamp(min=0).unsqueeze(1)  # [B, 1]
    return q, k_cache, v_cache, tables, context_lens, positions


def _reference(q, k_cache, v_cache, tables, context_lens, positions, window, sinks, softcap):
    context = tables.shape[1] * BLOCK
    mask = context_mask(positions, context_lens, context, window)
    keys, values = gather_context(k_cache, tables), gather_context(v_cache, tables)
    return paged_attention(q, keys, values, mask, 0.3, sinks, softcap)[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "dim_v"), [(6, 2, 64, 64), (4, 4, 24, 24), (3, 1, 16, 40)]
)
@pytest.mark.parametrize("variant", ["plain", "window", "sinks", "softcap"])
def test_equals_the_graphs_form(op, dtype, heads, kv_heads, dim, dim_v, variant):
    """Grouped heads, widths on and off the 16-lane vectors, a value width of its own, sliding
    windows, GPT-OSS's sinks and Gemma 2's softcap; padding rows give zeros."""
    q, k_cache, v_cache, tables, lens, positions = _case(dtype, heads, kv_heads, dim, dim_v)
    window = 5 if variant == "window" else None
    sinks = torch.randn(heads).to(dtype) if variant == "sinks" else None
    softcap = 2.0 if variant == "softcap" else None
    # bf16 against float32 on the same values: the kernel keeps scores and probabilities in
    # float32 (the graph's form rounds them to bf16 between its matmuls)
    wide = [t.float() if t is not None else None for t in (q, k_cache, v_cache, sinks)]
    want = _reference(wide[0], wide[1], wide[2], tables, lens, positions, window, wide[3], softcap)
    hi = torch.minimum(positions[:, 0], lens - 1)
    lo = visible_from(positions[:, 0], window, None)
    got = op(q[:, 0], k_cache, v_cache, tables, lo, hi, sinks, 0.3, softcap or 0.0)
    assert got.dtype == dtype and got.shape == (4, heads * dim_v)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's rounding
    torch.testing.assert_close(got[:3].float(), want[:3].float(), rtol=tol, atol=tol)
    assert not got[3].any()  # padding row


@pytest.mark.parametrize("window", [None, 3])
def test_packed_prefill_equals_the_graphs_form(op, window):
    """A packed prefill row: three sequences' chunks side by side (the second resuming at
    position 5), each token against its own sequence's keys through that sequence's table;
    the graph's form scores every token against all three contexts, masked."""
    _, k_cache, v_cache, tables, _, _ = _case(torch.float32, 6, 2, 32, 32, seed=3)
    tables = tables[:3].clone()
    tables[2] = tables[0].roll(1)
    seq_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    positions = torch.tensor([[0, 1, 2, 5, 6, 0, 1, 2, 3]])
    context_lens = torch.tensor([3, 7, 4])
    tokens = seq_ids.shape[1]
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, tokens, 6, 32, generator=gen)
    got = kernel_attention(
        q,
        k_cache,
        v_cache,
        packed_visible_keys(positions, seq_ids, context_lens, tables, window),
        0.3,
    )
    context = tables.shape[1] * BLOCK
    mask = packed_context_mask(positions, seq_ids, context_lens, context, window)
    side_by_side = tables.reshape(1, -1)
    keys, values = gather_context(k_cache, side_by_side), gather_context(v_cache, side_by_side)
    want = paged_attention(q, keys, values, mask, 0.3)
    assert got.shape == (1, tokens, 6 * 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused(op):
    q, k_cache, v_cache, tables, lens, positions = _case(torch.float32, 6, 2, 64, 64)
    with pytest.raises(RuntimeError, match="dtype"):
        op(q[:, 0].bfloat16(), k_cache, v_cache, tables, lens, lens, None, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="heads"):
        op(q[:, 0, :5], k_cache, v_cache, tables, lens, lens, None, 1.0, 0.0)


def test_decode_and_packed_prefill_graphs_attend_through_the_kernel(bundle):
    """cpu_kernel: auto (the test bundles' default) puts the attention of every decode graph and
    every packed prefill graph (rows > 1) through the kernel, and ships the library even where
    no projection takes the kernel; one sequence's prefill keeps the graph's form, and MLA's
    latent cache never takes it (HF parity, packed prompts included: test_generate)."""
    data = bundle_json(bundle("llama"))
    forms = {(g["phase"], g["buckets"]["rows"]): g.get("attention") for g in data["graphs"]}
    assert forms == {
        ("decode", 1): "kernel",
        ("decode", 4): "kernel",
        ("prefill", 1): None,
        ("prefill", 4): "kernel",
    }
    assert data["kernels"] == ["kernels/libneffkit_cpu.so"]
    mla = bundle_json(bundle("deepseek"))
    assert all("attention" not in g for g in mla["graphs"]) and not mla["kernels"]
