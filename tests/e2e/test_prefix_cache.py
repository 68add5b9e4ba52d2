"""Prefix caching on compiled bundles: the same tokens and logprobs with the cache on and off
under eviction and aborts, HF's greedy tokens on a hit, the OpenAI usage field and vLLM's metrics
through the real server and client, and a lowered neuron bundle serving a cached prefix on
XLA:CPU (the graphs do not change: a hit is a prefill that starts later)."""

from __future__ import annotations

import random

import pytest

from tests.support.cli import run_json

BLOCK = 16  # the test bundles' kv_cache.block_size


def _workload(seed: int) -> list[tuple[list[int], dict, bool]]:
    """100 requests over 6 shared prefixes of 1-3 blocks with random suffixes; greedy and
    seeded sampling, each with 2 logprobs; about one in eight aborted mid-decode."""
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(3, 1000) for _ in range(BLOCK * rng.randint(1, 3))] for _ in range(6)
    ]
    out = []
    for _ in range(100):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 8))]
        sampled = rng.random() < 0.5
        params = dict(
            max_tokens=rng.randint(2, 8),
            ignore_eos=True,
            logprobs=2,
            temperature=0.9 if sampled else 0.0,
            seed=rng.randrange(10**6) if sampled else None,
        )
        out.append((prompt, params, rng.random() < 0.125))
    return out


def _serve(loaded, workload, caching: bool):
    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.sampling_params import SamplingParams

    core = EngineCore(loaded.runner, prefix_caching=caching)
    seqs = []
    for i, (prompt, params, _) in enumerate(workload):
        seqs.append(core.add_request(prompt, SamplingParams(**params)))
        if i % 4 == 3:
            core.step()
        while core.has_work() and i == len(workload) - 1:
            core.step()
        for seq, (_, _, abort) in zip(seqs, workload, strict=False):
            if abort and len(seq.output_ids) >= 2 and not seq.finished:
                core.abort(seq)
    return core, seqs


def test_outputs_are_the_same_with_and_without_the_cache(bundle):
    """17 blocks of 16 tokens (the llama bundle) hold far less than the workload: evictions."""
    from neffkit.runtime.engine.loading import load

    loaded = load(bundle("llama"))
    workload = _workload(seed=1)
    cached, with_cache = _serve(loaded, workload, caching=True)
    plain, without = _serve(loaded, workload, caching=False)
    compared = 0
    for a, b in zip(with_cache, without, strict=True):
        if "abort" in (a.finish_reason, b.finish_reason):
            continue
        compared += 1
        assert a.output_ids == b.output_ids
        for la, lb in zip(a.output_logprobs, b.output_logprobs, strict=True):
            assert la.top_ids == lb.top_ids
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
    sched = cached.scheduler
    assert compared > 70 and sched.cache_hits > 0 and sched.allocator.evictions > 0
    assert plain.scheduler.cache_hits == 0
    assert sched.allocator.num_free == sched.allocator.num_usable


def _one_after_another(loaded, prompts, tokens: int, caching: bool = True):
    """Each prompt once the one before has finished (requests admitted together cannot hit each
    other's blocks: none is cached before its prefill)."""
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.sampling_params import SamplingParams

    llm = LLM(loaded, prefix_caching=caching)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [llm.generate([p], params)[0] for p in prompts]


def test_a_hit_generates_hf_greedy_and_reports_cached_tokens(bundle, hf_model_dir, hf_greedy):
    from neffkit.runtime.engine.loading import load

    prefix = list(range(200, 240))  # 40 tokens: 2 full blocks
    prompts = [prefix + [7, 8], prefix + [9]]
    loaded = load(bundle("llama"))
    first, second = _one_after_another(loaded, prompts, 8)
    assert first.num_cached == 0 and second.num_cached == 2 * BLOCK
    for p, seq in zip(prompts, (first, second), strict=True):
        assert seq.output_ids == hf_greedy(hf_model_dir("llama"), p, 8)
    off = _one_after_another(loaded, prompts, 8, caching=False)
    assert [s.num_cached for s in off] == [0, 0]
    assert [s.output_ids for s in off] == [first.output_ids, second.output_ids]
    report = run_json(
        "run",
        str(bundle("llama")),
        "--max-tokens",
        "2",
        "--prompt-ids",
        ",".join(map(str, prompts[0])),
    )
    assert report["outputs"][0]["cached_tokens"] == 0
    assert report["timings"]["cached_prompt_tokens"] == 0


def test_lowered_bundle_serves_a_cached_prefix_on_xla_cpu(lowered, hf_model_dir, hf_greedy):
    from neffkit.runtime.engine.loading import load

    prefix = list(range(300, 320))  # 20 tokens: one full block
    prompts = [prefix + [5], prefix + [6, 7]]
    seqs = _one_after_another(load(lowered("llama"), executor="xla-cpu"), prompts, 6)
    assert [s.num_cached for s in seqs] == [0, BLOCK]
    for p, seq in zip(prompts, seqs, strict=True):
        assert seq.output_ids == hf_greedy(hf_model_dir("llama"), p, 6)
