"""On-device sampling: greedy, temperature, top-k, top-p, with a per-row seed and no RNG state.

Randomness comes from a counter-based integer hash of (seed, position, candidate) turned into Gumbel
noise, so a graph is a pure function of its inputs: same seed → same tokens on every target and
rank, and nothing stateful is captured by torch.export. Temperature 0 means greedy (argmax).

A row with neither top-k nor top-p (`top_k <= 0`, `top_p >= 1`) samples the whole vocabulary
exactly, by inverse CDF with one uniform per row: O(vocab), no sort (a full-vocabulary sort costs
2.2 ms per row at a 32k vocabulary on this CPU, 10 ms at 128k). Rows with top-k or top-p choose
among the `max_top_k` most likely tokens (a static shape; the manifest's cap, and a request asking
for a larger top_k is refused before it reaches the graph).

Logprobs are the raw log-softmax of the logits (before temperature, as vLLM returns them): the
sampled token's and the `num_logprobs` most likely tokens', from one log-normaliser, so a greedy
token's logprob equals the first top logprob bit for bit (lm-eval's `is_greedy` compares them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_MASK32 = 0xFFFFFFFF


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """`x >> bits` for non-negative x, as truncating division.

    torch-mlir cannot lower `aten.__rshift__.Scalar` to StableHLO, and floor division lowers
    through float64; truncating division lowers to an integer `stablehlo.divide` and equals the
    shift for the non-negative values used here.
    """
    return torch.div(x, 1 << bits, rounding_mode="trunc")


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (lowbias32) on int64 tensors holding values below 2**32."""
    x = x & _MASK32
    x = ((x ^ _shr(x, 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ _shr(x, 15)) * 0x846CA68B) & _MASK32
    return x ^ _shr(x, 16)


def uniform_noise(seed: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """[B] seeds, [B] positions → [B, width] floats in (0, 1), deterministic."""
    row = _hash32(seed ^ _hash32(positions + 0x9E3779B9))  # [B]
    lanes = torch.arange(width, device=seed.device, dtype=torch.int64)  # [width]
    bits = _hash32(row.unsqueeze(1) * 0x10001 + lanes)  # [B, width]
    return (_shr(bits, 8).float() + 0.5) / float(1 << 24)


class Sampled(NamedTuple):
    """A graph's sampling outputs, in output order."""

    next_tokens: torch.Tensor  # [B] int64
    token_logprobs: torch.Tensor  # [B] float32: log p(next_token)
    top_logprob_ids: torch.Tensor  # [B, N] int64, most likely first
    top_logprobs: torch.Tensor  # [B, N] float32


def sample(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B] float32
    top_k: torch.Tensor,  # [B] int64
    top_p: torch.Tensor,  # [B] float32
    seed: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64, position of the sampled token's predecessor
    max_top_k: int,
    num_logprobs: int,
    processed: torch.Tensor | None = None,  # [B, V] float32: what to sample from (logits.py)
    branches: bool = False,
) -> Sampled:
    """Tokens sampled from `processed` (default: the logits), logprobs reported from `logits`
    (vLLM's raw logprobs: after a grammar's mask, before bias, penalties and temperature).

    `branches` (Inductor targets): a step whose rows are all greedy skips the drawing (a
    `torch.cond`), and the vocabulary is ranked by chunks (`top_by_chunks`). Without it every
    step runs every path, as a static graph for XLA must: the tokens are the same either way
    (but for exact ties between top candidates, which the two rankings may order apart)."""
    logits = logits.float()
    chosen_from = logits if processed is None else processed
    greedy = torch.argmax(chosen_from, dim=-1)  # [B]; first max, like HF
    width = min(max_top_k, logits.shape[-1])
    params = (temperature, top_k, top_p, seed, positions)
    if branches:

        def drawn(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
            return _draw(*top_by_chunks(x, width), x, *rest)

        any_drawn = (temperature > 0).any()
        tokens = torch.cond(any_drawn, drawn, _greedy, (chosen_from, *params, greedy))
        ranked_logits, ranked_ids = top_by_chunks(logits, num_logprobs)
    else:
        # one sort serves the candidates and the top logprobs (two when they rank different
        # logits)
        depth = max(width, num_logprobs) if processed is None else width
        ranked_logits, ranked_ids = torch.topk(chosen_from, depth, dim=-1)
        candidates = ranked_logits[:, :width], ranked_ids[:, :width]  # [B, K], descending
        tokens = _draw(*candidates, chosen_from, *params, greedy)
        if processed is not None:
            ranked_logits, ranked_ids = torch.topk(logits, num_logprobs, dim=-1)
    normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)  # [B, 1]
    token_logprobs = (logits.gather(1, tokens.unsqueeze(1)) - normaliser).squeeze(1)
    top = ranked_logits[:, :num_logprobs] - normaliser
    return Sampled(tokens, token_logprobs, ranked_ids[:, :num_logprobs], top)


def _greedy(*args: torch.Tensor) -> torch.Tensor:
    """`sample`'s branch when no row draws: the greedy tokens (a copy: a branch of
    `torch.cond` may not return its input)."""
    return args[-1].clone()


def _draw(
    cand_logits: torch.Tensor,  # [B, K] descending
    cand_ids: torch.Tensor,  # [B, K]
    chosen_from: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    positions: torch.Tensor,
    greedy: torch.Tensor,
) -> torch.Tensor:  # [B] int64
    """Each row's token: greedy at temperature 0, else drawn among the candidates (top-k /
    top-p) or from the whole vocabulary."""
    width = cand_logits.shape[-1]
    lane = torch.arange(width, device=cand_logits.device)  # [K]
    k_eff = torch.where(top_k > 0, top_k.clamp(max=width), width)  # [B]
    scaled = cand_logits / temperature.clamp(min=1e-5).unsqueeze(1)  # [B, K]
    scaled = torch.where(lane < k_eff.unsqueeze(1), scaled, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [B, K]; lane 0 is always kept
    scaled = torch.where(mass_before < top_p.unsqueeze(1), scaled, float("-inf"))
    gumbel = -torch.log(-torch.log(uniform_noise(seed, positions, width)))
    choice = torch.argmax(scaled + gumbel, dim=-1, keepdim=True)  # [B, 1]
    sampled = cand_ids.gather(1, choice).squeeze(1)
    whole = _sample_whole_vocabulary(chosen_from, temperature, seed, positions)
    truncated = (top_k > 0) | (top_p < 1)
    return torch.where(temperature > 0, torch.where(truncated, sampled, whole), greedy)


RANK_CHUNK = 64  # logits a chunk of `top_by_chunks`


def top_by_chunks(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(x, k, dim=-1)` of [B, V] by chunks of RANK_CHUNK: the k largest values lie in
    the k chunks with the largest maxima, so one vectorised max pass and two small sorts replace
    a sort of the whole row (ATen's topk: 345 µs for 8 rows of 49 152 logits on a 2-core AMD
    EPYC, 59 µs this way). The values are topk's exactly; equal values may come in another
    order."""
    rows, vocab = x.shape
    if vocab // RANK_CHUNK < 4 * k:  # a small vocabulary: nothing to gain
        return torch.topk(x, k, dim=-1)
    pad = -vocab % RANK_CHUNK
    chunks = torch.nn.functional.pad(x, (0, pad), value=float("-inf")).reshape(rows, -1, RANK_CHUNK)
    _, best = torch.topk(chunks.amax(dim=-1), k, dim=-1)  # [B, k] chunk indices
    picked = chunks.gather(1, best.unsqueeze(-1).expand(rows, k, RANK_CHUNK))  # [B, k, C]
    values, lane = torch.topk(picked.reshape(rows, -1), k, dim=-1)
    ids = best.gather(1, torch.div(lane, RANK_CHUNK, rounding_mode="floor")) * RANK_CHUNK
    return values, ids + lane % RANK_CHUNK


def target_logprobs(
    logits: torch.Tensor,  # [T, V]: one row per prompt position
    targets: torch.Tensor,  # [T] int64: the token that follows each position
    num_logprobs: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [T], [T, N] ids, [T, N] logprobs
    """Prompt logprobs (echo, lm-eval's loglikelihood): log p(target) and the top N per row."""
    logits = logits.float()
    normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen = (logits.gather(1, targets.unsqueeze(1)) - normaliser).squeeze(1)
    top_logits, top_ids = torch.topk(logits, num_logprobs, dim=-1)
    return chosen, top_ids, top_logits - normaliser


def _sample_whole_vocabulary(
    logits: torch.Tensor,  # [B, V] float32
    temperature: torch.Tensor,  # [B]
    seed: torch.Tensor,  # [B]
    positions: torch.Tensor,  # [B]
) -> torch.Tensor:  # [B] int64
    """softmax(logits / T) sampled by inverse CDF: the first token whose cumulative mass reaches
    u · total (any fixed token order is a valid CDF, so no sort)."""
    probs = torch.softmax(logits / temperature.clamp(min=1e-5).unsqueeze(1), dim=-1)
    cdf = torch.cumsum(probs, dim=-1)  # [B, V]
    # [B, 1]; an offset position, so not the noise of any candidate lane (a scalar XOR on the
    # seed would do the same, but torch-mlir has no lowering for `bitwise_xor.Scalar`)
    u = uniform_noise(seed, positions + (1 << 30), 1)
    index = (cdf < u * cdf[:, -1:]).sum(dim=-1)
    return index.clamp(max=logits.shape[-1] - 1)
