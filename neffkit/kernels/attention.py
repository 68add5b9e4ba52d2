"""Paged attention over gathered context, masked by position, context length and window."""

from __future__ import annotations

import torch

# Finite so fully masked (padding) rows give a uniform softmax instead of NaN.
MASK_VALUE = -1e30


def visible_from(positions: torch.Tensor, window: int | None, chunk: int | None) -> torch.Tensor:
    """The first key a query at each position sees: 0, the window's start, or its chunk's."""
    lo = torch.zeros_like(positions)
    if window is not None:
        lo = (positions - window + 1).clamp(min=0)
    if chunk is not None:  # integer arithmetic: floor lowers through float64, which Trainium lacks
        lo = torch.maximum(lo, positions - torch.remainder(positions, chunk))
    return lo


def visible_range(
    positions: torch.Tensor,  # [B, T] int64
    context_lens: torch.Tensor,  # [B] int64, 0 for padding rows
    window: int | None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # lo, hi: [B, T]
    """The keys lo..hi a query at each position sees: hi = min(p, context_len - 1), lo from
    `visible_from` (a padding row, context_len 0, has hi = -1 < lo)."""
    hi = torch.minimum(positions, (context_lens - 1).unsqueeze(1))
    return visible_from(positions, window, chunk), hi


def packed_range(
    positions: torch.Tensor,  # [1, T] int64: each token's position in its own sequence
    seq_ids: torch.Tensor,  # [1, T] int64: each token's sequence, in [0, S)
    context_lens: torch.Tensor,  # [S] int64, 0 for padding sequences
    window: int | None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # own, lo, hi: [1, T]
    """visible_range for a packed prefill row: each token's sequence (clamped) and its key
    range in that sequence."""
    own = seq_ids.clamp(0, context_lens.shape[0] - 1)  # host-given index: clamped (NK303)
    hi = torch.minimum(positions, context_lens.index_select(0, own[0]).unsqueeze(0) - 1)
    return own, visible_from(positions, window, chunk), hi


def visible_keys(
    positions: torch.Tensor,  # [B, T] int64: decode T = 1, verify 1 + K
    context_lens: torch.Tensor,  # [B] int64, 0 for padding rows
    block_tables: torch.Tensor,  # [B, C // block_size] int64
    window: int | None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # lo, hi [B*T]; tables [B*T, C // bs]
    """The keys lo..hi each query sees (context_mask's interval, as bounds for the kernel; a
    padding row has hi = -1 < lo) and the block table it reads them through, its row's."""
    tokens = positions.shape[1]
    lo, hi = visible_range(positions, context_lens, window, chunk)
    tables = block_tables if tokens == 1 else block_tables.repeat_interleave(tokens, dim=0)
    return lo.reshape(-1), hi.reshape(-1), tables


def packed_visible_keys(
    positions: torch.Tensor,  # [1, T] int64
    seq_ids: torch.Tensor,  # [1, T] int64, in [0, S)
    context_lens: torch.Tensor,  # [S] int64
    block_tables: torch.Tensor,  # [S, C // block_size] int64
    window: int | None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # lo, hi [T]; tables [T, C // bs]
    """visible_keys for a packed prefill row: each token's key range in its own sequence, and
    that sequence's block table, one per token."""
    own, lo, hi = packed_range(positions, seq_ids, context_lens, window, chunk)
    return lo[0], hi[0], block_tables.index_select(0, own[0])


def context_mask(
    positions: torch.Tensor,  # [B, T] int64
    context_lens: torch.Tensor,  # [B] int64, 0 for padding rows
    context: int,
    window: int | None,
    chunk: int | None = None,
) -> torch.Tensor:  # [B, T, C] bool
    """Key j is visible to a query at position p iff lo <= j <= hi, lo = max(0, p - window + 1),
    hi = min(p, context_len - 1); with `chunk` (Llama 4's chunked attention) lo is the start of
    p's chunk, p - p % chunk.

    Written as one comparison |2j - lo - hi| <= hi - lo instead of an AND of two broadcast masks:
    neuronx-cc miscompiles a broadcast boolean AND of a large mask with a [1, N] mask (CHRS-985).
    Padding rows (context_len 0) get hi = -1 < lo, so nothing is visible.
    """
    lo, hi = visible_range(positions, context_lens, window, chunk)  # [B, T]
    keys = torch.arange(context, device=positions.device)  # [C]
    centre = (lo + hi).unsqueeze(-1)  # [B, T, 1]
    radius = (hi - lo).unsqueeze(-1)  # [B, T, 1]
    return (2 * keys - centre).abs() <= radius


def packed_context_mask(
    positions: torch.Tensor,  # [1, T] int64: each token's position in its own sequence
    seq_ids: torch.Tensor,  # [1, T] int64: each token's sequence, in [0, S)
    context_lens: torch.Tensor,  # [S] int64, 0 for padding sequences
    context: int,
    window: int | None,
    chunk: int | None = None,
) -> torch.Tensor:  # [1, T, S * C] bool
    """context_mask for a packed prefill row: the S sequences' contexts lie side by side
    (sequence s's key j at s * C + j), and a token sees keys lo..hi of its own sequence only.

    The same single comparison as context_mask, shifted by the token's sequence offset: the
    visible interval lies inside that sequence's C keys, so no second (AND) mask is needed."""
    seqs = context_lens.shape[0]
    own, lo, hi = packed_range(positions, seq_ids, context_lens, window, chunk)
    offset = own * context
    keys = torch.arange(seqs * context, device=positions.device)  # [S*C]
    centre = (lo + hi + 2 * offset).unsqueeze(-1)  # [1, T, 1]
    radius = (hi - lo).unsqueeze(-1)
    return (2 * keys - centre).abs() <= radius


# rows of a few queries each (speculation's verify graphs): their groups and tokens fold into one
# axis, so each KV head is one plain batched matmul; as [B, KV, G, T] with K broadcast over the
# groups Inductor's code costs 5.8x a one-token row for five tokens (SmolLM2's 9 heads / 3 KV
# heads, 512 keys, 2 cores: 518 us a layer against 237 folded)
FEW_QUERIES = 8


def _few_queries(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """paged_attention for 1 < T <= FEW_QUERIES, the queries of a KV head in one matmul."""
    rows, tokens, heads, dim = q.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    q = q.reshape(rows, tokens, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(rows, kv_heads, group * tokens, dim)  # [B, KV, G*T, D]
    scores = torch.matmul(q, keys.permute(0, 2, 3, 1))  # [B, KV, G*T, C]
    if bias is not None:
        scores = scores + bias.reshape(scores.shape)
    scores = scores * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    context = mask.shape[-1]
    visible = mask[:, None, None].expand(rows, 1, group, tokens, context)
    visible = visible.reshape(rows, 1, group * tokens, context)
    probs = torch.softmax(torch.where(visible, scores.float(), MASK_VALUE), dim=-1).to(q.dtype)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [B, KV, G*T, Dv]
    out = out.reshape(rows, kv_heads, group, tokens, -1).permute(0, 3, 1, 2, 4)
    return out.reshape(rows, tokens, -1)


def paged_attention(
    q: torch.Tensor,  # [B, T, H, D]
    keys: torch.Tensor,  # [B, C, KV, D]
    values: torch.Tensor,  # [B, C, KV, Dv]
    mask: torch.Tensor,  # [B, T, C] bool
    scale: float,
    sinks: torch.Tensor | None = None,  # [H]: GPT-OSS's learned logit per head
    softcap: float | None = None,  # Gemma 2: scores become softcap * tanh(scores / softcap)
    bias: torch.Tensor | None = None,  # [B, KV, G, T, C]: added to q.k before the scale
) -> torch.Tensor:  # [B, T, H * Dv]
    """Grouped-query attention: query head h reads KV head h // (H // KV), like HF repeat_kv.

    With `sinks`, each head's softmax also counts exp(sink) in its denominator (a column that
    takes probability mass and is then dropped), as GPT-OSS's attention does. `bias` is the
    part of q.k the keys do not hold (an fp8 cache's key offsets: kernels/kv.offset_scores).
    """
    rows, tokens, heads, dim = q.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    if 1 < tokens <= FEW_QUERIES and sinks is None:
        return _few_queries(q, keys, values, mask, scale, softcap, bias)
    q = q.reshape(rows, tokens, kv_heads, group, dim).permute(0, 2, 3, 1, 4)  # [B, KV, G, T, D]
    k = keys.permute(0, 2, 1, 3).unsqueeze(2)  # [B, KV, 1, C, D]
    v = values.permute(0, 2, 1, 3).unsqueeze(2)  # [B, KV, 1, C, D]
    scores = torch.matmul(q, k.transpose(-1, -2))  # [B, KV, G, T, C]
    if bias is not None:
        scores = scores + bias
    scores = scores * scale
    if softcap is not None:  # as HF: after the scale, before the mask
        scores = torch.tanh(scores / softcap) * softcap
    scores = torch.where(mask[:, None, None], scores.float(), MASK_VALUE)
    if sinks is not None:
        sink = sinks.float().reshape(1, kv_heads, group, 1, 1).expand(rows, -1, -1, tokens, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, v)  # [B, KV, G, T, D]
    return out.permute(0, 3, 1, 2, 4).reshape(rows, tokens, -1)  # value width may differ from D


def kernel_attention(
    q: torch.Tensor,  # [B, T, H, D]: decode [B, 1], packed prefill [1, T]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D], q's dtype
    v_cache: torch.Tensor,  # [num_blocks, block_size, KV, Dv]
    bounds: tuple[torch.Tensor, ...],  # (lo, hi, tables): [B*T], [B*T], [B*T, C // bs]
    scale: float,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [B, T, H * Dv]
    """paged_attention through neffkit's cpu kernel (platform/csrc/decode_attention.cpp), each
    query against only its keys lo..hi, read from the cache through its own block table, where
    the graph's form gathers, scores and masks the whole context bucket (a packed row: every
    sequence's)."""
    rows, tokens, heads, dim = q.shape
    lo, hi, tables = bounds
    out = torch.ops.neffkit.paged_decode_attention(
        q.reshape(rows * tokens, heads, dim),
        k_cache,
        v_cache,
        tables,
        lo,
        hi,
        sinks,
        scale,
        softcap or 0.0,
    )
    return out.view(rows, tokens, -1)
