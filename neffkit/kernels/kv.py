"""Paged KV cache writes and reads: one K and one V tensor per layer (MLA: one latent tensor),
block 0 is the null block."""

from __future__ import annotations

import torch


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    k: torch.Tensor,  # [N, KV, D]
    v: torch.Tensor,  # [N, KV, D]
    slot_mapping: torch.Tensor,  # [N] int64, -1 = padding
) -> None:
    """Scatter new keys/values into their slots with index_put_ (becomes an io-aliased output).

    Padding slots (-1) are clamped to the null block 0 *before* the division and `%`: on Neuron
    a -1 slot turns into an out-of-bounds DGE scatter that wedges the execution queue. Truncating
    division (equal to floor division once slots are non-negative) keeps the index math in
    integers; `//` lowers to StableHLO through float64.
    """
    index = slot_index(slot_mapping, k_cache.shape[1])  # once for both writes
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def to_cache(
    values: torch.Tensor,
    cache_dtype: torch.dtype,
    fp8_max: float,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Values as the cache stores them. An fp8 cache stores clamp(x / scale, ±fp8_max): `scale`
    is the layer's k_scale / v_scale from the checkpoint (a dequantization scale, vLLM's
    convention), 1.0 when it has none; fp8_max is 448, or 240 on trn1/trn2 (targets.fp8_max). A
    cast alone would turn anything past the range into NaN (or, on trn2, into e4m3 infinities).
    The clamp is the cast's direct input: the audit (NK202) checks exactly that."""
    if cache_dtype != torch.float8_e4m3fn:
        return values
    if scale is not None:
        values = values / scale.to(values.dtype)
    return values.clamp(-fp8_max, fp8_max).to(cache_dtype)


def key_rotation(dim: int) -> torch.Tensor:
    """The orthonormal [dim, dim] matrix an fp8 cache's keys and their queries are rotated by:
    Sylvester's Hadamard matrix over 1/sqrt(n), block-diagonal in the largest power-of-two
    blocks that divide `dim` (96: three of 32). It spreads the few channels where keys and
    queries concentrate over all of them, so e4m3's relative rounding no longer lands on the
    channels that make up most of every score (QuaRot's observation; float32)."""
    n = dim & -dim  # the largest power of two dividing dim
    block = torch.ones(1, 1)
    while block.shape[0] < n:
        block = torch.cat([torch.cat([block, block], 1), torch.cat([block, -block], 1)], 0)
    return torch.block_diag(*[block / n**0.5] * (dim // n))


def stored_keys(
    k: torch.Tensor,  # [..., KV, D]
    offsets: torch.Tensor,  # [..., KV, D]: key_offsets at each key's position
    smooth: torch.Tensor,  # [KV, D]
    rotation: torch.Tensor,  # [D, D], key_rotation
) -> torch.Tensor:
    """((k - offset) * smooth) R: what an fp8 cache with rotated keys rounds. The offset is the
    layer's calibrated mean key rotated to the key's position (a pre-RoPE mean: the part of a
    key that RoPE turns with the position, which no single post-RoPE mean removes), so what is
    left is small; `smooth` weighs each channel by sqrt(|q| / |k|) there (SmoothQuant's
    balance, queries divided alike), and R spreads the result over every channel."""
    return ((k - offsets.to(k.dtype)) * smooth.to(k.dtype)) @ rotation.to(k.dtype)


def stored_queries(
    q: torch.Tensor,  # [..., H, D]
    smooth: torch.Tensor,  # [KV, D]
    rotation: torch.Tensor,  # [D, D]
) -> torch.Tensor:
    """(q / smooth) R, query head h divided by its KV head's weights: with stored_keys, the
    product with a stored key is q . (k - offset)."""
    group = q.shape[-2] // smooth.shape[0]
    return (q / smooth.to(q.dtype).repeat_interleave(group, 0)) @ rotation.to(q.dtype)


def offset_scores(
    q: torch.Tensor,  # [B, T, H, D]: the query as RoPE left it
    offsets: torch.Tensor,  # [1, C, KV, D]: key_offsets at each context position
) -> torch.Tensor:  # [B, KV, G, T, C]
    """q . offset(c) for every query and context key, what paged_attention adds to q_stored .
    stored so the scores are q . k exactly (sinks and soft caps then see the same values). One
    matmul per KV head against offsets shared by every row: neither widening the keys by the
    offsets (a copy of the context per row) nor rotating them into the stored form (a D x D
    product per context position)."""
    rows, tokens, heads, dim = q.shape
    kv_heads, context = offsets.shape[2], offsets.shape[1]
    group = heads // kv_heads
    q = q.reshape(rows, tokens, kv_heads, group, dim).permute(2, 0, 3, 1, 4)
    per_head = offsets[0].to(q.dtype).permute(1, 2, 0)  # [KV, D, C]
    scores = torch.bmm(q.reshape(kv_heads, rows * group * tokens, dim), per_head)
    return scores.view(kv_heads, rows, group, tokens, context).permute(1, 0, 2, 3, 4)


def rope_offset_scores(
    q: torch.Tensor,  # [B, T, H, D]: the query as RoPE left it
    coefs: torch.Tensor,  # [KV, 2D]: what the offset's cos and sin terms multiply
    first: torch.Tensor,  # [KV, D]: the offset at position 0
    table: torch.Tensor,  # [C, D]: the first halves of cos and sin at each context position
    positions: torch.Tensor,  # [C]
) -> torch.Tensor:  # [B, KV, G, T, C]
    """offset_scores where the offset is a mean put through RoPE, rotary(m, cos, sin) = a * cos
    + b * sin: q . offset(c) = (q * a) . cos_c + (q * b) . sin_c, one matmul against the
    context's cos/sin table that every layer and head shares, no offsets built per layer. RoPE's
    tables repeat their first half (rope_cos_sin), so each term's halves are summed first."""
    rows, tokens, heads, dim = q.shape
    kv_heads = coefs.shape[0]
    q = q.reshape(rows, tokens, kv_heads, heads // kv_heads, dim)
    weighted = torch.cat((q, q), -1) * coefs.to(q.dtype)[:, None]  # [B, T, KV, G, 2D]
    folded = weighted.unflatten(-1, (2, 2, dim // 2)).sum(-2).flatten(-2)  # [B, T, KV, G, D]
    scores = folded @ table.to(q.dtype).T  # [B, T, KV, G, C]
    at_first = (q * first.to(q.dtype)[:, None]).sum(-1, keepdim=True)
    scores = torch.where(positions == 0, at_first, scores)
    return scores.permute(0, 2, 3, 1, 4)


def from_cache(
    cached: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Cached values in the compute dtype: widened, times the layer's scale for fp8."""
    wide = cached.to(dtype)
    return wide * scale.to(dtype) if scale is not None else wide


def write_cache(
    cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    values: torch.Tensor,  # [N, KV, D]
    slot_mapping: torch.Tensor,  # [N] int64, -1 = padding
) -> None:
    """One cache tensor's scatter (an MLA layer has one: its latent cache)."""
    cache.index_put_(slot_index(slot_mapping, cache.shape[1]), values)


def slot_index(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of each slot, padding (-1) clamped to the null block first."""
    slots = slot_mapping.clamp(min=0)
    return torch.div(slots, block_size, rounding_mode="trunc"), slots % block_size


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    block_tables: torch.Tensor,  # [B, C // block_size] int64, -1 past the valid blocks
) -> torch.Tensor:  # [B, C, KV, D]
    """Read each row's context through its block table; -1 entries read block 0 (masked later)."""
    rows, blocks = block_tables.shape
    gathered = cache[block_tables.clamp(min=0)]  # [B, C/bs, bs, KV, D]
    return gathered.reshape(rows, blocks * cache.shape[1], cache.shape[2], cache.shape[3])
