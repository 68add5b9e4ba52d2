"""Kernel behaviours the graph contract depends on, checked on plain torch tensors."""

from __future__ import annotations

import pytest
import torch

from neffkit.kernels.attention import context_mask, paged_attention
from neffkit.kernels.kv import gather_context, write_kv
from neffkit.kernels.sampling import sample, target_logprobs


def test_padding_slot_writes_to_null_block():
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    k = torch.ones(2, 1, 3)
    write_kv(k_cache, v_cache, k, 2 * k, torch.tensor([5, -1]))
    assert k_cache[2, 1].eq(1).all() and v_cache[2, 1].eq(2).all()  # slot 5 = block 2, offset 1
    assert k_cache[0, 0].eq(1).all()  # -1 went to the null block, not to block 3 offset 1
    assert k_cache[3].eq(0).all()


def test_mask_is_causal_bounded_and_windowed():
    positions = torch.tensor([[0, 1, 2, 3]])
    mask = context_mask(positions, torch.tensor([4]), context=6, window=None)
    assert mask[0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
    ]
    windowed = context_mask(positions, torch.tensor([4]), context=6, window=2)
    assert windowed[0, 3].int().tolist() == [0, 0, 1, 1, 0, 0]


def test_padded_rows_attend_to_nothing_and_stay_finite():
    mask = context_mask(torch.tensor([[0]]), torch.tensor([0]), context=4, window=None)
    assert not mask.any()
    q = torch.randn(1, 1, 2, 4)
    kv = torch.randn(1, 4, 1, 4)
    out = paged_attention(q, kv, kv, mask, 0.5)
    assert torch.isfinite(out).all()


def test_gather_reads_block_table_order():
    cache = torch.arange(3 * 2).float().reshape(3, 2, 1, 1)
    ctx = gather_context(cache, torch.tensor([[2, 1, -1]]))
    assert ctx.flatten().tolist() == [4, 5, 2, 3, 0, 1]


def _sample(logits, temperature, top_k=0, top_p=1.0, seed=0, pos=0):
    rows = logits.shape[0]
    return sample(
        logits,
        torch.full((rows,), temperature),
        torch.full((rows,), top_k),
        torch.full((rows,), top_p),
        torch.full((rows,), seed),
        torch.full((rows,), pos),
        max_top_k=8,
        num_logprobs=3,
    ).next_tokens


def test_sampling_greedy_seeded_and_top_k():
    torch.manual_seed(0)
    logits = torch.randn(64, 50)
    assert torch.equal(_sample(logits, 0.0), logits.argmax(-1))
    a = _sample(logits, 1.0, seed=7)
    assert torch.equal(a, _sample(logits, 1.0, seed=7))
    assert not torch.equal(a, _sample(logits, 1.0, seed=8))
    assert not torch.equal(a, _sample(logits, 1.0, seed=7, pos=1))
    top2 = logits.topk(2, dim=-1).indices
    picked = _sample(logits, 5.0, top_k=2, seed=3)
    assert (picked.unsqueeze(1) == top2).any(1).all()
    assert not torch.equal(picked, logits.argmax(-1))  # hot temperature does pick the second
    assert torch.equal(_sample(logits, 1.0, top_k=1, seed=3), logits.argmax(-1))


def test_sampling_top_p_keeps_only_the_head():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]]).repeat(200, 1)
    seeds = torch.arange(200)
    out = sample(
        logits,
        torch.ones(200),
        torch.zeros(200, dtype=torch.long),
        torch.full((200,), 0.9),
        seeds,
        torch.zeros(200, dtype=torch.long),
        max_top_k=4,
        num_logprobs=2,
    ).next_tokens
    assert set(out.tolist()) == {0, 1}  # p(0)+p(1) ≈ 0.97 > 0.9, lane 2 is cut


def _expected(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(logits / T) over the top-k, then the smallest head whose mass reaches top_p."""
    order = logits.argsort(descending=True)
    probs = torch.softmax(logits[order].double() / temperature, dim=0)
    if top_k > 0:
        probs[top_k:] = 0
        probs /= probs.sum()
    before = probs.cumsum(0) - probs
    probs[before >= top_p] = 0
    out = torch.zeros_like(probs)
    out[order] = probs / probs.sum()
    return out


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "candidates"),
    [
        (1.0, 0, 1.0, 4),  # no top-k/top-p: the whole vocabulary, whatever the candidates
        (0.7, 0, 1.0, 12),
        (1.3, 5, 1.0, 12),
        (1.0, 0, 0.8, 12),
        (2.0, 6, 0.9, 8),
    ],
)
def test_sampled_frequencies_match_the_distribution(temperature, top_k, top_p, candidates):
    """Chi-square goodness of fit over 40000 draws (one row per seed) of a 12-token vocabulary:
    p-value above 1e-4."""
    draws = 40000
    logits = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.5, 0.2, 0.0, -0.3, -1.0, -1.5, -2.0, -3.0])
    out = sample(
        logits.repeat(draws, 1),
        torch.full((draws,), temperature),
        torch.full((draws,), top_k),
        torch.full((draws,), top_p),
        torch.arange(draws),  # one seed per draw
        torch.full((draws,), 17),
        max_top_k=candidates,
        num_logprobs=1,
    ).next_tokens
    observed = torch.bincount(out, minlength=logits.numel()).double()
    expected = _expected(logits, temperature, top_k, top_p) * draws
    assert (observed[expected == 0] == 0).all()  # nothing outside top-k / top-p
    kept = expected > 0
    chi2 = ((observed[kept] - expected[kept]) ** 2 / expected[kept]).sum()
    dof = int(kept.sum()) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2), chi2 / 2).item()
    assert p_value > 1e-4, (chi2.item(), dof, observed.tolist(), expected.tolist())


@pytest.mark.parametrize("num_logprobs", [1, 5, 20])  # fewer, and more, than the candidates
def test_logprobs_are_the_raw_log_softmax(num_logprobs) -> None:
    """Before temperature (vLLM's default), for the sampled token and the top N; a greedy
    token's logprob is the first top logprob exactly (lm-eval's is_greedy compares them)."""
    torch.manual_seed(1)
    logits = torch.randn(6, 40) * 3
    temperature = torch.tensor([0.0, 0.0, 0.7, 1.0, 1.5, 1.0])
    out = sample(
        logits,
        temperature,
        torch.zeros(6, dtype=torch.long),
        torch.ones(6),
        torch.arange(6),
        torch.zeros(6, dtype=torch.long),
        max_top_k=8,
        num_logprobs=num_logprobs,
    )
    want = torch.log_softmax(logits.double(), dim=-1)
    chosen = want.gather(1, out.next_tokens.unsqueeze(1)).squeeze(1)
    assert torch.allclose(out.token_logprobs.double(), chosen, atol=1e-5)
    top = want.topk(num_logprobs, dim=-1)
    assert torch.equal(out.top_logprob_ids, top.indices)
    assert torch.allclose(out.top_logprobs.double(), top.values, atol=1e-5)
    assert torch.equal(out.token_logprobs[:2], out.top_logprobs[:2, 0])  # the greedy rows


def test_prompt_logprobs_score_each_target() -> None:
    torch.manual_seed(2)
    logits, targets = torch.randn(9, 30), torch.randint(0, 30, (9,))
    chosen, top_ids, top = target_logprobs(logits, targets, 4)
    want = torch.log_softmax(logits.double(), dim=-1)
    assert torch.allclose(chosen.double(), want[torch.arange(9), targets], atol=1e-5)
    assert torch.equal(top_ids, want.topk(4, dim=-1).indices)
    assert torch.allclose(top.double(), want.topk(4, dim=-1).values, atol=1e-5)


@pytest.mark.parametrize("fp8_max", [448.0, 240.0])
def test_fp8_cache_round_trip_scales_and_clamps(fp8_max: float):
    """An fp8 cache stores clamp(x / scale, ±fp8_max) and reads it back times the scale: with a
    calibrated scale small values keep e4m3's 3 mantissa bits (relative error <= 1/16); without
    one they fall into fp8's subnormals; anything past the range is clamped (never NaN)."""
    from neffkit.kernels.kv import from_cache, to_cache

    fp8 = torch.float8_e4m3fn
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 16, generator=gen) * 1e-3  # |x| ~ 1e-3: fp8 subnormals unscaled
    scale = x.abs().max().reshape(1) / fp8_max
    stored = to_cache(x, fp8, fp8_max, scale)
    assert stored.dtype == fp8 and stored.float().abs().max() <= fp8_max
    back = from_cache(stored, torch.float32, scale)
    assert ((back - x).abs() <= x.abs() / 16 + 1e-12).all()
    unscaled = from_cache(to_cache(x, fp8, fp8_max), torch.float32)
    assert (unscaled - x).abs().max() > 4 * (back - x).abs().max()
    big = to_cache(torch.tensor([1e4, -1e4]), fp8, fp8_max)
    assert big.float().tolist() == [fp8_max, -fp8_max]  # both exact in e4m3fn
    assert to_cache(x, torch.float32, fp8_max, scale) is x  # other caches store x as it is


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 20])
def test_projection_forms_equal_the_plain_matmul(rows: int, dtype: torch.dtype) -> None:
    """Every form `project` writes (cpu's blocked rows/bmm, the plain reduction, mm, dot) is
    x @ W.T, through AOTInductor as well as eagerly (the forms exist for what Inductor makes
    of them; weights stay graph inputs)."""
    from neffkit.models.forms import LANES, PLAIN, ProjectionPolicy
    from neffkit.models.projection import from_blocked, out_features, project, to_blocked

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 40, generator=gen).to(dtype)
    x = torch.randn(rows, 1, 40, generator=gen).to(dtype)
    blocked = to_blocked(weight, LANES)
    assert blocked.shape == (3, 40, LANES) and torch.equal(from_blocked(blocked), weight)
    assert out_features(blocked) == out_features(weight) == 48
    expected = (x.float() @ weight.float().t()).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    cpu = ProjectionPolicy(max_rows=8, lanes=LANES)
    for policy, w in ((cpu, blocked), (cpu, weight), (PLAIN, blocked), (PLAIN, weight)):
        out = project(x, w, policy)
        assert out.shape == (rows, 1, 48) and out.dtype == dtype
        torch.testing.assert_close(out, expected, **tol)
    assert cpu.form(rows, blocked=True) == ("blocked-rows" if rows <= 8 else "blocked-bmm")
    assert PLAIN.form(rows, blocked=False) == "dot"


@pytest.mark.parametrize(("tokens", "softcap"), [(2, None), (5, None), (5, 3.0)])
def test_few_query_attention_equals_the_general_form(tokens, softcap, monkeypatch) -> None:
    """Verify graphs' rows of a few queries fold groups and tokens into one matmul axis: the
    same attention as the general form, masks and soft-capping included."""
    import neffkit.kernels.attention as attention

    gen = torch.Generator().manual_seed(tokens)
    q = torch.randn(2, tokens, 8, 16, generator=gen)
    k, v = torch.randn(2, 40, 2, 16, generator=gen), torch.randn(2, 40, 2, 12, generator=gen)
    mask = torch.rand(2, tokens, 40, generator=gen) > 0.3
    mask[..., 0] = True
    folded = attention.paged_attention(q, k, v, mask, 0.25, None, softcap)
    monkeypatch.setattr(attention, "FEW_QUERIES", 0)
    general = attention.paged_attention(q, k, v, mask, 0.25, None, softcap)
    torch.testing.assert_close(folded, general, rtol=1e-6, atol=1e-6)
