"""Optimistic admission, preemption by recompute and priority scheduling (engine/policy.py,
scheduler.py) against the paged-sum fake model, whose every token reads the whole KV cache
through the block tables: a recomputed sequence with a wrong block, position or seed gives a
different token from the oracle."""

from __future__ import annotations

import random

import pytest

from neffkit.contract.records import SpeculationRecord
from neffkit.errors import NeffkitError, RequestError
from neffkit.runtime.config import SchedulingOptions
from neffkit.runtime.engine.core import EngineCore
from neffkit.runtime.sampling_params import SamplingParams
from tests.fake_model import fake_runner, oracle
from tests.unit.test_scheduler import drain

GREEDY = dict(temperature=0.0, ignore_eos=True)


def core(num_blocks: int, policy: str = "fcfs", **layout) -> EngineCore:
    runner, _ = fake_runner(num_blocks=num_blocks, **layout)
    return EngineCore(runner, scheduling=SchedulingOptions(policy))


def test_blocks_are_taken_as_decode_needs_them() -> None:
    # 5 usable blocks of 8 tokens: an 8-token prompt is admitted on 1 block, not its budget's 3
    engine = core(num_blocks=6)
    sched = engine.scheduler
    params = SamplingParams(max_tokens=16, **GREEDY)
    a = engine.add_request(list(range(1, 9)), params)
    b = engine.add_request(list(range(11, 19)), params)
    engine.step()
    assert len(a.blocks) == 2 and len(b.blocks) == 1  # a decoded once: its 9th token's block
    drain(engine)
    assert a.output_ids == oracle(list(range(1, 9)), 16)
    assert b.output_ids == oracle(list(range(11, 19)), 16)
    assert sched.preemptions >= 1  # 6 blocks wanted at the end, 5 there
    assert sched.allocator.num_free == 5 and sched.kv_usage == 0.0


def _workload(rng: random.Random, n: int) -> list[tuple[list[int], SamplingParams]]:
    out = []
    for _ in range(n):
        prompt = [rng.randrange(1, 90) for _ in range(rng.randint(3, 30))]
        sampled = rng.random() < 0.5
        params = SamplingParams(
            max_tokens=rng.randint(10, 30),
            temperature=0.8 if sampled else 0.0,
            seed=rng.randrange(1000) if sampled else None,
            ignore_eos=True,
        )
        out.append((prompt, params))
    return out


@pytest.mark.parametrize("speculation", [None, SpeculationRecord("ngram", 3, 4)])
def test_a_small_pool_preempts_and_every_request_equals_its_run_alone(speculation) -> None:
    rng = random.Random(7)
    work = _workload(rng, 16)
    engine = core(num_blocks=33, context=(64,), speculation=speculation)
    seqs = [engine.add_request(p, params) for p, params in work]
    drain(engine, max_steps=4000)
    assert engine.scheduler.preemptions > 0
    for seq, (prompt, params) in zip(seqs, work, strict=True):
        seed = params.seed or 0
        want = oracle(prompt, params.max_tokens, seed, sampled=params.temperature > 0)
        assert seq.output_ids == want, (seq.request_id, seq.preemptions)
    assert engine.scheduler.allocator.num_free == 32


def test_prefix_cache_is_hit_when_a_preempted_request_recomputes() -> None:
    engine = core(num_blocks=9)  # 8 usable: two requests of 5 blocks at the end
    params = SamplingParams(max_tokens=24, **GREEDY)
    prompts = [list(range(1, 13)), list(range(31, 43))]
    seqs = [engine.add_request(p, params) for p in prompts]
    drain(engine)
    assert engine.scheduler.preemptions >= 1
    assert [s.output_ids for s in seqs] == [oracle(p, 24) for p in prompts]
    preempted = next(s for s in seqs if s.preemptions)
    assert preempted.num_cached == 0  # reported: its first admission's (nothing was cached)
    assert engine.scheduler.cache_hits > 0  # no shared prefix: the recompute found its own


def test_priority_arrival_goes_first_and_preempts_a_lower_one() -> None:
    # 4 usable blocks: one request of 24 tokens at a time
    engine = core(num_blocks=5, policy="priority")
    params = SamplingParams(max_tokens=16, **GREEDY)
    low = [
        engine.add_request([i, i + 1, i + 2, 4, 5, 6, 7, 8], params, priority=10) for i in (1, 2)
    ]
    for _ in range(3):
        engine.step()
    high = engine.add_request([9] * 8, params, priority=0)
    order = []
    while engine.has_work():
        engine.step()
        order += [s for s in (*low, high) if s.finished and s not in order]
    assert order.index(high) < order.index(low[1])  # before the earlier low one still waiting
    assert engine.scheduler.preemptions >= 1  # the running low one gave way
    assert high.output_ids == oracle([9] * 8, 16)
    assert [s.output_ids for s in low] == [oracle(s.prompt_ids, 16) for s in low]


def test_fcfs_refuses_a_priority_and_options_are_checked() -> None:
    engine = core(num_blocks=9)
    params = SamplingParams(max_tokens=4, **GREEDY)
    with pytest.raises(RequestError) as err:
        engine.add_request([1, 2], params, priority=3)
    assert err.value.param == "priority" and "--scheduling-policy priority" in err.value.hint
    engine.add_request([1, 2], params, priority=0)
    runner, _ = fake_runner(num_blocks=9)
    with pytest.raises(NeffkitError, match="--num-gpu-blocks-override 10: .* holds 9 blocks"):
        EngineCore(runner, scheduling=SchedulingOptions(num_blocks=10))
    with pytest.raises(NeffkitError, match="--scheduling-policy 'lifo'"):
        EngineCore(runner, scheduling=SchedulingOptions("lifo"))


def test_a_smaller_pool_than_built_is_used_and_a_request_too_big_for_it_is_refused() -> None:
    runner, _ = fake_runner(num_blocks=33)
    engine = EngineCore(runner, scheduling=SchedulingOptions(num_blocks=4))
    assert engine.scheduler.allocator.num_usable == 3
    with pytest.raises(RequestError, match="needs 4 KV blocks of 8 tokens; the KV pool holds 3"):
        engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=8, **GREEDY))
    seq = engine.add_request(list(range(1, 9)), SamplingParams(max_tokens=16, **GREEDY))
    drain(engine)
    assert seq.output_ids == oracle(list(range(1, 9)), 16)
