"""Speculative decoding against the fake paged model: prompt lookup's drafts, the verify step's
acceptance and the scheduler around it. A fake that repeats its input with a period makes the
drafts often right, so runs of accepted tokens are common and stops and max_tokens fall inside
them; outputs must equal plain decoding's (and the oracle's) token for token."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from neffkit.contract.records import SpeculationRecord
from neffkit.runtime.engine.core import EngineCore
from neffkit.runtime.sampling_params import SamplingParams
from neffkit.runtime.spec_decode.ngram import propose
from neffkit.runtime.spec_decode.proposer import BACKOFF_STEPS, MISSES_BEFORE_BACKOFF
from tests.fake_model import EOS, fake_runner, oracle
from tests.support.matchers import OpenMatcher

PERIOD = 5
NGRAM = SpeculationRecord("ngram", num_tokens=3, max_batch=4)


@pytest.mark.parametrize(
    ("tokens", "k", "want"),
    [
        ([1, 2, 3, 4, 5, 9, 1, 2, 3], 3, [4, 5, 9]),  # the longest suffix (3) seen before
        ([5, 6, 7, 8], 3, []),  # no repeat
        ([7, 7, 7, 7], 3, [7]),  # only one token follows the match
        ([256, 1, 0, 0, 1, 0], 2, [0, 1]),  # token-aligned matches only (256 = bytes 00 01 ..)
        ([1, 2, 9, 1, 2, 8, 1, 2], 2, [8, 1]),  # the most recent occurrence
        ([1, 2, 3, 1, 2], 0, []),
    ],
)
def test_prompt_lookup(tokens, k, want) -> None:
    assert propose(tokens, k, 2, 4) == want


def _core(batch: tuple[int, ...], speculation: bool):
    runner, model = fake_runner(
        decode=batch, context=(64, 128), num_blocks=129, speculation=NGRAM, period=PERIOD
    )
    return EngineCore(runner, speculation=speculation), model


def _workload(seed: int, n: int = 200) -> list[tuple[list[int], SamplingParams]]:
    """Prompts that repeat (periodic heads) so drafts land; stops and max_tokens anywhere."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        head = [rng.randrange(1, 90) for _ in range(PERIOD)]
        prompt = (head * 4)[: rng.randint(PERIOD + 2, 3 * PERIOD)]
        sampled = rng.random() < 0.3
        stop = (rng.choice(head),) if rng.random() < 0.3 else ()
        out.append(
            (
                prompt,
                SamplingParams(
                    max_tokens=rng.randint(1, 30),
                    temperature=0.7 if sampled else 0.0,
                    seed=rng.randrange(50) if sampled else None,
                    stop_token_ids=stop,
                    ignore_eos=rng.random() < 0.5,
                ),
            )
        )
    return out


def _run(core: EngineCore, workload) -> list:
    seqs = []
    for i, (prompt, params) in enumerate(workload):
        seqs.append(core.add_request(prompt, params))
        if i % 3 == 2:
            core.step()
    while core.has_work():
        core.step()
    return seqs


@pytest.mark.parametrize("batch", [(1,), (1, 4)])
def test_speculation_emits_what_plain_decoding_does(batch) -> None:
    workload = _workload(seed=len(batch))
    spec, model = _core(batch, speculation=True)
    plain, _ = _core(batch, speculation=False)
    with_spec, without = _run(spec, workload), _run(plain, workload)
    for (prompt, params), a, b in zip(workload, with_spec, without, strict=True):
        assert a.output_ids == b.output_ids
        assert a.finish_reason == b.finish_reason
        assert len(a.output_ids) <= params.max_tokens
        if a.finish_reason == "stop":  # nothing after the stop token or EOS
            assert a.output_ids[-1] in (*params.stop_token_ids, EOS)
        sampled = params.temperature > 0
        full = oracle(prompt, params.max_tokens, a.seed, sampled, period=PERIOD)
        assert a.output_ids == full[: len(a.output_ids)]
    counts = spec.scheduler.spec
    assert counts.drafts > 50 and counts.accepted_tokens > counts.drafts  # runs accepted
    assert counts.accepted_per_position[0] >= counts.accepted_per_position[-1] > 0
    assert any(name.startswith("verify") for name, _ in model.calls)
    assert spec.scheduler.allocator.num_free == spec.scheduler.allocator.num_usable


def test_no_verify_step_without_drafts_or_above_max_batch() -> None:
    runner, model = fake_runner(
        decode=(1, 4),
        context=(64,),
        num_blocks=65,
        speculation=SpeculationRecord("ngram", 3, max_batch=1),
    )
    core = EngineCore(runner)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    core.add_request([10, 20, 30, 40], params)  # nothing repeats: no drafts, plain decode
    while core.has_work():
        core.step()
    assert not any(n.startswith("verify") for n, _ in model.calls)
    for _ in range(2):  # two rows: above max_batch 1
        core.add_request([1, 2, 1, 2, 1, 2], params)
    while core.has_work():
        core.step()
    assert not any(n.startswith("verify") for n, _ in model.calls)


def test_rows_whose_drafts_keep_failing_back_off() -> None:
    """The sum model (no period) never repeats what prompt lookup proposes."""
    runner, model = fake_runner(context=(128,), num_blocks=65, speculation=NGRAM)
    core = EngineCore(runner)
    (seq,) = [
        core.add_request(
            [3, 4] * 6, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        )
    ]
    while core.has_work():
        core.step()
    verify = sum(n.startswith("verify") for n, _ in model.calls)
    assert seq.output_ids == oracle([3, 4] * 6, 60)
    assert verify <= MISSES_BEFORE_BACKOFF * (1 + 60 // BACKOFF_STEPS)


def _draft_core(batch: tuple[int, ...], draft_period: int | None, prefix_caching: bool = True):
    """A target fake that repeats with PERIOD and a draft model fake of its own (own cache,
    own verify-shaped and decode graphs): the same function proposes what the target emits;
    another proposes mostly wrong tokens."""
    from neffkit.runtime.spec_decode.draft import DraftModel

    spec = SpeculationRecord("draft", num_tokens=3, max_batch=4, draft="draft")
    shape = dict(decode=batch, context=(64, 128), num_blocks=129)
    runner, model = fake_runner(**shape, speculation=spec, period=PERIOD)
    draft_runner, draft_model = fake_runner(
        **shape, speculation=SpeculationRecord("ngram", 3, 4), period=draft_period
    )
    runner.draft = DraftModel(draft_runner, spec)
    return EngineCore(runner, prefix_caching=prefix_caching), model, draft_model


@pytest.mark.parametrize("batch", [(1,), (1, 4)])
def test_a_draft_model_of_the_same_function_has_every_greedy_draft_accepted(batch) -> None:
    """The fake's cache holds a hash of each position's whole prefix, so a draft whose cache
    missed a token, or wrote one at the wrong position or slot, would propose a wrong token:
    every greedy draft accepted means the draft's cache follows the sequence exactly, through
    prefills, catch-ups after fully accepted runs, back-offs and prefix-cache hits."""
    rng = random.Random(5)
    heads = [[rng.randrange(1, 90) for _ in range(PERIOD)] * 4 for _ in range(3)]  # 2.5 blocks
    workload = [
        (rng.choice(heads)[: rng.randint(10, 20)] + p[:3], replace(params, temperature=0.0))
        for p, params in _workload(seed=5)
    ]
    core, model, draft = _draft_core(batch, draft_period=PERIOD)
    plain, _ = _core(batch, speculation=False)
    for (prompt, params), a, b in zip(
        workload, _run(core, workload), _run(plain, workload), strict=True
    ):
        full = oracle(prompt, params.max_tokens, period=PERIOD)
        assert a.output_ids == b.output_ids == full[: len(a.output_ids)]
        assert a.finish_reason == b.finish_reason
    counts = core.scheduler.spec
    assert counts.drafts > 100 and counts.accepted_tokens == counts.draft_tokens
    assert any(n.startswith("prefill") for n, _ in draft.calls)  # it prefilled the prompts
    assert core.scheduler.cache_hits > 0  # prompts shared prefixes
    assert core.scheduler.allocator.num_free == core.scheduler.allocator.num_usable


@pytest.mark.parametrize("batch", [(1,), (1, 4)])
def test_a_draft_model_that_guesses_wrong_changes_no_output(batch) -> None:
    """A draft that does not repeat (the plain sum fake): drafts rejected at every position,
    sampled rows too; outputs equal plain decoding's and the oracle's."""
    workload = _workload(seed=6)
    core, model, draft = _draft_core(batch, draft_period=None)
    plain, _ = _core(batch, speculation=False)
    for (prompt, params), a, b in zip(
        workload, _run(core, workload), _run(plain, workload), strict=True
    ):
        assert a.output_ids == b.output_ids
        full = oracle(prompt, params.max_tokens, a.seed, params.temperature > 0, period=PERIOD)
        assert a.output_ids == full[: len(a.output_ids)]
    counts = core.scheduler.spec
    assert counts.drafts > 50 and counts.accepted_tokens < counts.draft_tokens
    assert any(n.startswith("verify") for n, _ in draft.calls)
    assert any(n.startswith("decode") for n, _ in draft.calls)


def test_a_draft_model_catches_up_after_plain_decode_steps() -> None:
    """Five rows above max_batch 4 decode plainly while the draft sits out; once rows finish,
    the draft catches up on many tokens in several 1 + K chunks and its drafts are right."""
    core, model, draft = _draft_core((1, 4, 8), draft_period=PERIOD)
    params = [
        SamplingParams(max_tokens=40 + 6 * i, temperature=0.0, ignore_eos=True) for i in range(5)
    ]
    prompts = [[i + 1, i + 2, i + 3, i + 4, i + 5, i + 6] for i in range(5)]
    seqs = [core.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    while core.has_work():
        core.step()
    for p, q, s in zip(prompts, params, seqs, strict=True):
        assert s.output_ids == oracle(p, q.max_tokens, period=PERIOD)
    counts = core.scheduler.spec
    assert counts.drafts > 0 and counts.accepted_tokens == counts.draft_tokens
    assert any(n.startswith("decode_8x") for n, _ in model.calls)  # plain steps happened


def test_rows_with_a_grammar_get_no_drafts_but_advance_it() -> None:
    """Drafts would need the grammar's state at every position: a constrained row decodes
    plainly (its matcher sees every token once), its neighbours still speculate."""
    core, model = _core((1, 4), speculation=True)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompt = [7, 8, 9, 10, 11] * 3
    constrained = core.add_request(prompt, params)
    constrained.grammar = matcher = OpenMatcher()
    assert not constrained.may_draft
    while core.has_work():
        core.step()
    assert not any(n.startswith("verify") for n, _ in model.calls)  # alone: plain decoding
    assert matcher.consumed == constrained.output_ids == oracle(prompt, 20, period=PERIOD)
    asked: dict[int, list[int]] = {}  # request id → the draft counts asked of the proposer
    propose = core.scheduler.proposer

    def recording(rows, ks):
        for seq, k in zip(rows, ks, strict=True):
            asked.setdefault(seq.request_id, []).append(k)
        return propose(rows, ks)

    core.scheduler.proposer = recording
    free = core.add_request(prompt, params)
    constrained = core.add_request(prompt, params)
    constrained.grammar = matcher = OpenMatcher()
    while core.has_work():
        core.step()
    assert any(n.startswith("verify") for n, _ in model.calls)  # the free row speculates
    assert set(asked[constrained.request_id]) == {0} and max(asked[free.request_id]) > 0
    assert free.output_ids == constrained.output_ids == matcher.consumed
