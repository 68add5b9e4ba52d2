"""Penalties, logit_bias, min_tokens and grammar bitmasks in the graph (kernels/logits.py, laid out
by runtime/worker/logit_inputs.py) against a dense reference written from vLLM's rules: its
`apply_penalties` (bin counts of the prompt and output tokens; repetition divides positive logits
and multiplies the rest for tokens in either, frequency × output count and presence × seen in the
output are subtracted), min_tokens and logit_bias before the penalties, and the bitmask before
everything (the logprobs a request reports come from the masked logits)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neffkit.contract import abi
from neffkit.contract.abi import GraphShape
from neffkit.kernels.logits import LogitInputs, process
from neffkit.kernels.sampling import sample, top_by_chunks
from neffkit.runtime.sampling_params import SamplingParams
from neffkit.runtime.worker.batch import SequenceState
from neffkit.runtime.worker.logit_inputs import Penalties, fill_bitmasks, write_row
from neffkit.runtime.worker.runner import padded_metadata

VOCAB = 300  # not a multiple of 32: the last bitmask word is partial
EOS = (7,)
ROWS = 4


def reference(
    logits: np.ndarray,  # [N, V] float32
    prompts: list[list[int]],
    outputs: list[list[int]],
    params: list[SamplingParams],
    masks: list[np.ndarray | None],  # per row: allowed[V] bools
) -> tuple[np.ndarray, np.ndarray]:
    """(masked, processed) as vLLM computes them, dense and row by row."""
    masked = logits.astype(np.float64).copy()
    for r, allowed in enumerate(masks):
        if allowed is not None:
            masked[r, ~allowed] = -np.inf
    x = masked.copy()
    for r, p in enumerate(params):
        if len(outputs[r]) < p.min_tokens:  # vLLM's MinTokensLogitsProcessor
            for t in (*EOS, *p.stop_token_ids):
                x[r, t] = -np.inf
        for t, bias in p.logit_bias:  # LogitBiasLogitsProcessor
            x[r, t] += bias
        prompt_mask = np.bincount(prompts[r], minlength=VOCAB) > 0
        output_counts = np.bincount(outputs[r], minlength=VOCAB).astype(np.float64)
        output_mask = output_counts > 0
        if p.repetition_penalty != 1.0:
            penalties = np.where(prompt_mask | output_mask, p.repetition_penalty, 1.0)
            x[r] = np.where(x[r] > 0, x[r] / penalties, x[r] * penalties)
        x[r] -= p.frequency_penalty * output_counts
        x[r] -= p.presence_penalty * output_mask
    return masked, x


def _bits(allowed: np.ndarray) -> np.ndarray:
    """allowed[V] → int32 words, bit v % 32 of word v // 32 (written with shifts and sums, unlike
    the graph's bit tests)."""
    words = np.zeros(-(-VOCAB // 32), np.int64)
    for v in np.flatnonzero(allowed):
        words[v // 32] += 1 << (v % 32)
    return words.astype(np.uint32).view(np.int32)


class _Grammar:
    """A stand-in matcher whose mask is fixed: what llguidance's executor would write."""

    def __init__(self, allowed: np.ndarray) -> None:
        self.words = _bits(allowed)


class _Grammars:
    def fill(self, bitmask: np.ndarray, rows: list) -> None:
        for matcher, row in rows:
            bitmask[row] = matcher.words


def _rows(rng: np.random.Generator):
    params = [
        SamplingParams(max_tokens=64),
        SamplingParams(
            max_tokens=64,
            repetition_penalty=1.7,
            frequency_penalty=0.6,
            presence_penalty=-0.4,
            logit_bias=((3, 5.0), (250, -2.5)),
        ),
        SamplingParams(
            max_tokens=64, repetition_penalty=0.8, min_tokens=20, stop_token_ids=(11, 12)
        ),
        SamplingParams(max_tokens=64, presence_penalty=1.5, logit_bias=((299, 100.0),)),
    ]
    prompts = [list(rng.integers(0, VOCAB, n)) for n in (5, 40, 17, 3)]
    outputs = [list(rng.integers(0, 30, n)) for n in (0, 25, 9, 30)]  # repeats in a small range
    masks = [None, rng.random(VOCAB) < 0.5, None, rng.random(VOCAB) < 0.1]
    return params, prompts, outputs, masks


def _meta(params, prompts, outputs, masks, width: int = 128, bias: int = 8):
    """The graph inputs the runtime writes for these rows (Penalties fed one token at a time)."""
    shape = GraphShape(
        phase="decode",
        rows=ROWS,
        tokens=1,
        context=64,
        block_size=16,
        num_blocks=8,
        logprobs=5,
        bitmask_words=-(-VOCAB // 32),
        penalty_tokens=width,
        bias_tokens=bias,
    )
    specs = tuple((s.name, s.shape, s.dtype) for s in abi.logit_inputs(shape))
    meta = padded_metadata(specs)
    seqs = []
    for r, p in enumerate(params):
        seq = SequenceState(r, prompts[r], p, seed=0)
        if p.penalized:
            seq.penalties = Penalties(width, p, seq.prompt_ids)
        for t in outputs[r]:
            seq.output_ids.append(int(t))
            if seq.penalties is not None:
                seq.penalties.add(int(t))
        seq.grammar = None if masks[r] is None else _Grammar(masks[r])
        write_row(meta, r, seq, EOS)
        seqs.append(seq)
    fill_bitmasks(meta, [s.grammar for s in seqs], _Grammars())  # type: ignore[arg-type]
    return LogitInputs.of({k: torch.from_numpy(v) for k, v in meta.items()}, abi.LOGIT_INPUTS)


def test_graph_processing_equals_vllms_rules():
    rng = np.random.default_rng(0)
    params, prompts, outputs, masks = _rows(rng)
    logits = (rng.standard_normal((ROWS, VOCAB)) * 4).astype(np.float32)
    logits[:, :10] = 0.0  # exact zeros: repetition leaves them alone either way
    inputs = _meta(params, prompts, outputs, masks)
    masked, processed = process(torch.from_numpy(logits), inputs)
    want_masked, want = reference(logits, prompts, outputs, params, masks)
    assert processed is not None
    np.testing.assert_array_equal(np.isinf(masked.numpy()), np.isinf(want_masked))
    np.testing.assert_allclose(processed.numpy(), want, rtol=1e-6, atol=1e-5)
    # the first row asked for nothing: it comes out bit for bit
    assert torch.equal(processed[0], torch.from_numpy(logits[0]))


def test_sampling_reports_masked_logprobs_and_samples_processed():
    """Greedy picks the processed argmax; logprobs are the masked log-softmax (vLLM's raw
    logprobs) of the token and the top ones; a masked token is never sampled, greedy or not."""
    rng = np.random.default_rng(1)
    params, prompts, outputs, masks = _rows(rng)
    logits = torch.from_numpy((rng.standard_normal((ROWS, VOCAB)) * 4).astype(np.float32))
    inputs = _meta(params, prompts, outputs, masks)
    masked, processed = process(logits, inputs)
    zeros = torch.zeros(ROWS)
    ints = torch.zeros(ROWS, dtype=torch.int64)
    greedy = sample(
        masked, zeros, ints, torch.ones(ROWS), ints, torch.arange(ROWS), 16, 5, processed
    )
    _, want = reference(logits.numpy(), prompts, outputs, params, masks)
    assert greedy.next_tokens.tolist() == list(np.argmax(want, axis=1))
    raw = torch.log_softmax(masked, dim=-1)
    chosen = raw.gather(1, greedy.next_tokens[:, None])[:, 0]
    np.testing.assert_allclose(greedy.token_logprobs, chosen, atol=1e-6)
    np.testing.assert_allclose(greedy.top_logprobs, torch.topk(raw, 5).values, atol=1e-6)
    for seed in range(20):
        hot = sample(
            masked,
            torch.full((ROWS,), 2.0),
            torch.zeros(ROWS, dtype=torch.int64),
            torch.ones(ROWS),
            torch.full((ROWS,), seed),
            torch.arange(ROWS),
            16,
            5,
            processed,
        )
        for r, allowed in enumerate(masks):
            if allowed is not None:
                assert allowed[hot.next_tokens[r]]


@pytest.mark.parametrize("width", [1, 40])
def test_penalty_pairs_bound_what_a_request_may_see(width):
    p = SamplingParams(max_tokens=8, repetition_penalty=1.2)
    assert Penalties.bound(p, [1, 1, 2, 3], 8) == 3 + 8
    assert Penalties.bound(SamplingParams(max_tokens=8, presence_penalty=1.0), [1, 2], 8) == 8
    pen = Penalties(width + 3, p, [5, 5, 6])
    pen.add(5)
    pen.add(9)
    pen.add(9)
    ids = pen.ids.tolist()
    assert ids[:3] == [5, 6, 9] and set(ids[3:]) == {-1}
    assert pen.counts[:3].tolist() == [1.0, 0.0, 2.0]


def test_verify_rows_repeat_per_position():
    """A verify graph's values repeat over each row's T positions, its bitmask is per position."""
    words = -(-VOCAB // 32)
    inputs = LogitInputs(
        torch.arange(2 * 3 * words, dtype=torch.int32).reshape(2, 3, words),
        torch.tensor([[1, -1], [2, 3]]),
        torch.ones(2, 2),
        torch.tensor([0.1, 0.2]),
        torch.zeros(2),
        torch.ones(2),
        None,
        None,
    )
    flat = inputs.per_position(3)
    assert flat.bitmask.shape == (6, words) and flat.bitmask[4, 0] == 4 * words
    assert flat.penalty_ids.tolist() == [[1, -1]] * 3 + [[2, 3]] * 3
    assert flat.presence.tolist() == pytest.approx([0.1] * 3 + [0.2] * 3)


@pytest.mark.parametrize("masked_rows", [True, False])
@pytest.mark.parametrize("temperatures", [(0.0, 0.0, 0.0, 0.0), (0.0, 2.0, 0.0, 0.7)])
def test_the_branching_sampler_equals_the_static_one(masked_rows, temperatures):
    """cpu graphs skip the drawing when every row is greedy and the mask when it allows every
    token (torch.cond), and rank the vocabulary by chunks: every output equals the static form's
    (the one XLA targets trace), drawn rows and top-k / top-p rows included."""
    rng = np.random.default_rng(2)
    params, prompts, outputs, masks = _rows(rng)
    masks = masks if masked_rows else [None] * ROWS
    logits = torch.from_numpy((rng.standard_normal((ROWS, VOCAB)) * 4).astype(np.float32))
    inputs = _meta(params, prompts, outputs, masks)
    static = process(logits, inputs)
    branching = process(logits, inputs, branches=True)
    assert all(torch.equal(a, b) for a, b in zip(static, branching, strict=True))
    top_k, top_p = torch.tensor([0, 5, 0, 0]), torch.tensor([1.0, 1.0, 1.0, 0.8])
    sampling = (
        torch.tensor(temperatures),
        top_k,
        top_p,
        torch.arange(ROWS) + 11,
        torch.arange(ROWS),
    )
    for seed_shift in range(5):
        seeds = (*sampling[:3], sampling[3] + seed_shift, sampling[4])
        want = sample(static[0], *seeds, 16, 5, static[1])
        got = sample(branching[0], *seeds, 16, 5, branching[1], branches=True)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("vocab", [300, 5000, 49152, 151936])
@pytest.mark.parametrize("k", [1, 5, 64])
def test_ranking_by_chunks_equals_topk(vocab, k):
    """Values and ids equal torch.topk's (no ties in random logits), vocabularies that are not a
    whole number of chunks included; -inf logits (masked tokens) rank last."""
    x = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab + k)) * 3
    x[1, ::3] = float("-inf")
    want, got = torch.topk(x, k, dim=-1), top_by_chunks(x, k)
    assert torch.equal(want.values, got[0]) and torch.equal(want.indices, got[1])
