"""Scheduler, runner metadata and engine core against a fake paged model: no g++, milliseconds.

As vLLM's tests/v1/core/test_scheduler.py does, the scheduling logic is fed a model whose outputs
are known (tests/fake_model.py): admission, chunked prefill, bucket choice, padding rows, KV-block
accounting, aborts and stop conditions are checked without compiling anything.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

from neffkit.errors import RequestError
from neffkit.runtime.engine.core import EngineCore
from neffkit.runtime.engine.limits import check_fits
from neffkit.runtime.engine.llm import LLM
from neffkit.runtime.sampling_params import SamplingParams
from tests.fake_model import EOS, fake_runner, oracle

GREEDY = dict(temperature=0.0, ignore_eos=True)


class FakeLoaded:
    """What LLM needs of a loaded bundle: its runner (no tokenizer: no structured outputs) and
    its rank count (one: the engine's threads are the thread governor's)."""

    tokenizer = None
    adapters = None  # built without adapter slots

    def __init__(self, runner) -> None:
        self.runner = runner
        self.bundle = SimpleNamespace(record=SimpleNamespace(layout=SimpleNamespace(world_size=1)))


def drain(core: EngineCore, until=None, max_steps: int = 500) -> None:
    """Step until `until()` (default: no work left); a scheduler that stalls fails, not hangs."""
    for _ in range(max_steps):
        if until() if until else not core.has_work():
            return
        core.step()
    raise AssertionError(f"no progress after {max_steps} steps")


def llm(**layout) -> tuple[LLM, object]:
    runner, model = fake_runner(**layout)
    return LLM(FakeLoaded(runner)), model


def test_chunked_prefill_and_batched_decode_match_the_oracle() -> None:
    engine, _ = llm()
    prompts = [[3, 4, 5], list(range(1, 38)), [9] * 16, [1, 2]]  # 37 tokens: 16 + 16 + 5
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, **GREEDY))
    assert [s.output_ids for s in outs] == [oracle(p, 10) for p in prompts]
    assert all(s.finish_reason == "length" for s in outs)


def test_more_sequences_than_the_largest_decode_bucket_all_progress() -> None:
    engine, model = llm(decode=(1, 2))
    prompts = [[i, i + 1] for i in range(1, 6)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=5, **GREEDY))
    assert [s.output_ids for s in outs] == [oracle(p, 5) for p in prompts]
    decode_rows = {meta["input_ids"].shape[0] for name, meta in model.calls if "decode" in name}
    assert decode_rows <= {1, 2}


def test_bucket_choice_is_the_smallest_that_fits() -> None:
    engine, model = llm()
    engine.generate([list(range(1, 21))], SamplingParams(max_tokens=4, **GREEDY))
    names = [name for name, _ in model.calls]
    # 20 tokens: a 16-token chunk (context 32), then 4 tokens in the 8 bucket; then decode at 21+
    assert names[:2] == ["prefill_1x16_c32", "prefill_1x8_c32"]
    assert set(names[2:]) == {"decode_1x1_c32"}
    engine.generate([list(range(1, 30))], SamplingParams(max_tokens=6, **GREEDY))
    assert model.calls[-1][0] == "decode_1x1_c64"  # 34 tokens attended: the 64 bucket


def test_padding_rows_write_nothing_and_attend_nothing() -> None:
    engine, model = llm()
    prompts = [[1, 2, 3], [4, 5], [6]]  # three rows in the 4-row decode bucket
    outs = engine.generate(prompts, SamplingParams(max_tokens=3, **GREEDY))
    assert [s.output_ids for s in outs] == [oracle(p, 3) for p in prompts]
    name, meta = next((n, m) for n, m in model.calls if n.startswith("decode_4"))
    pad = 3
    assert meta["slot_mapping"][pad, 0] == -1 and meta["context_lens"][pad] == 0
    assert (meta["block_tables"][pad] == -1).all() and meta["temperature"][pad] == 0


@pytest.mark.parametrize("where", ["waiting", "prefilling", "running"])
def test_abort_frees_blocks_wherever_the_request_is(where: str) -> None:
    engine, _ = llm(num_blocks=6)
    core, sched = engine.core, engine.core.scheduler
    params = SamplingParams(max_tokens=16, **GREEDY)
    first = core.add_request(list(range(1, 25)), params)  # 24 tokens: 3 blocks, 2 chunks
    second = core.add_request(list(range(40, 57)), params)  # 3 blocks of the 2 left
    core.step()  # first admitted and one chunk prefilled; second waits for blocks
    assert second in sched.waiting
    target = {"waiting": second, "prefilling": first, "running": first}[where]
    if where == "running":
        core.step()
        assert first in sched.running
    core.abort(target)
    assert target.finish_reason == "abort" and not target.blocks
    assert target not in sched.waiting and target not in sched.prefilling
    assert target not in sched.running
    drain(core)
    assert sched.allocator.num_free == 5


def test_stop_conditions() -> None:
    engine, _ = llm()
    prompt = [4, 6, 7]  # its 8 tokens hold no EOS
    ref = oracle(prompt, 8)
    (seq,) = engine.generate(
        [prompt], SamplingParams(max_tokens=8, stop_token_ids=(ref[2],), temperature=0.0)
    )
    assert seq.output_ids == ref[: ref.index(ref[2]) + 1] and seq.finish_reason == "stop"
    # a prompt whose next token is EOS stops there unless ignore_eos
    eos_prompt = [EOS]
    assert oracle(eos_prompt, 1) == [EOS]
    (seq,) = engine.generate([eos_prompt], SamplingParams(max_tokens=5, temperature=0.0))
    assert seq.output_ids == [EOS] and seq.finish_reason == "stop"
    (seq,) = engine.generate([eos_prompt], SamplingParams(max_tokens=5, **GREEDY))
    assert len(seq.output_ids) == 5 and seq.finish_reason == "length"


def test_rows_taken_over_get_their_own_sampling_values() -> None:
    """The sampled request finishes first; the greedy ones move into its row and must not keep
    its temperature or seed (decode metadata is updated in place)."""
    engine, _ = llm()
    sampled = SamplingParams(max_tokens=2, temperature=1.0, seed=7, ignore_eos=True)
    greedy = SamplingParams(max_tokens=9, **GREEDY)
    prompts = [[7, 8, 9], [40, 41, 42, 43], [50, 51]]
    outs = engine.generate(prompts, [sampled, greedy, greedy])
    assert outs[0].output_ids == oracle(prompts[0], 2, seed=7, sampled=True)
    assert [s.output_ids for s in outs[1:]] == [oracle(p, 9) for p in prompts[1:]]


def test_requests_that_cannot_fit_name_the_field() -> None:
    runner, _ = fake_runner()
    layout = runner.config
    with pytest.raises(RequestError) as err:
        check_fits(layout, [], SamplingParams())
    assert err.value.param == "prompt" and "empty" in err.value.message
    with pytest.raises(RequestError) as err:
        check_fits(layout, [1] * 60, SamplingParams(max_tokens=10))
    assert err.value.param == "prompt" and "context buckets: [32, 64]" in err.value.message
    runner, _ = fake_runner(num_blocks=4)  # 3 usable blocks: 24 tokens
    with pytest.raises(RequestError, match="needs 4 KV blocks of 8 tokens; the KV pool holds 3"):
        check_fits(runner.config, [1] * 20, SamplingParams(max_tokens=10))
    # LLM.generate checks every prompt before running any
    engine, model = llm()
    with pytest.raises(RequestError):
        engine.generate([[1, 2], [1] * 70], SamplingParams(max_tokens=2))
    assert model.calls == [] and not engine.core.has_work()


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 1.5}, "top_k"),
        ({"seed": "7"}, "seed"),
        ({"stop_token_ids": (1, "x")}, "stop_token_ids"),
    ],
)
def test_sampling_params_check_themselves(kwargs, param) -> None:
    with pytest.raises(RequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_unseeded_requests_get_distinct_seeds() -> None:
    runner, _ = fake_runner()
    core = EngineCore(runner)
    seeds = {core.add_request([1, 2], SamplingParams(max_tokens=1)).seed for _ in range(8)}
    assert len(seeds) > 1


def test_unset_max_tokens_runs_up_to_the_context_limit() -> None:
    engine, _ = llm()
    (seq,) = engine.generate([list(range(1, 11))], SamplingParams(max_tokens=None, **GREEDY))
    assert len(seq.output_ids) == 64 - 10 and seq.finish_reason == "length"
    assert seq.output_ids == oracle(list(range(1, 11)), 54)
    with pytest.raises(RequestError, match="exceeds the largest context bucket"):
        engine.generate([[1] * 64], SamplingParams(max_tokens=None))


def test_top_k_above_the_bundle_cap_is_refused() -> None:
    runner, _ = fake_runner()
    config = runner.config
    capped = dataclasses.replace(config, layout=dataclasses.replace(config.layout, max_top_k=16))
    check_fits(capped, [1, 2], SamplingParams(top_k=16))
    check_fits(capped, [1, 2], SamplingParams(top_k=0))  # unset: the cap's candidates
    with pytest.raises(RequestError) as err:
        check_fits(capped, [1, 2], SamplingParams(top_k=17))
    assert err.value.param == "top_k" and "sampling.max_top_k: 16" in err.value.message
    check_fits(runner.config, [1, 2], SamplingParams(top_k=10_000))  # no cap: any top_k


def test_max_tokens_zero_prefills_and_generates_nothing() -> None:
    """echo + logprobs with max_tokens 0 (lm-eval's loglikelihood): the prompt runs through
    prefill (in chunks), nothing is decoded, the blocks come back; others are unaffected."""
    engine, model = llm()
    prompt = list(range(1, 21))  # two chunks: 16 + 4
    only_prompt, other = engine.generate(
        [prompt, [5, 6, 7]],
        [SamplingParams(max_tokens=0, **GREEDY), SamplingParams(max_tokens=4, **GREEDY)],
    )
    assert only_prompt.output_ids == [] and only_prompt.finish_reason == "length"
    assert other.output_ids == oracle([5, 6, 7], 4)
    assert [name.split("_")[0] for name, _ in model.calls].count("prefill") == 3
    assert engine.core.scheduler.allocator.num_free == 32


def test_a_burst_of_prompts_prefills_packed() -> None:
    """buckets.prefill_batch: prompts arriving together prefill in one call, their tokens side
    by side in one row (per-token sequence ids), not one call per step; a long prompt's first
    chunk takes what is left of the token bucket and its rest follows; every token still
    equals the oracle's."""
    engine, model = llm(prefill_batch=(1, 4, 8), decode=(1, 4, 8), num_blocks=65)
    prompts = [[i, i + 2, i + 5] for i in range(1, 5)] + [list(range(1, 30))]  # 12 + 29 tokens
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, **GREEDY))
    assert [s.output_ids for s in outs] == [oracle(p, 6) for p in prompts]
    prefills = [(n, m) for n, m in model.calls if n.startswith("prefill")]
    # 4 x 3 tokens + 4 of the long prompt fill the 16-token bucket; then 16, then 9 (bucket 16)
    assert [n for n, _ in prefills] == ["prefill_8x16_c32", "prefill_1x16_c32", "prefill_1x16_c32"]
    first = prefills[0][1]
    assert list(first["seq_ids"][0]) == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3 + [4] * 4
    assert list(first["positions"][0]) == [0, 1, 2] * 4 + [0, 1, 2, 3]
    assert list(first["last_token_index"]) == [2, 5, 8, 11, 15, 0, 0, 0]
    assert list(first["context_lens"]) == [3, 3, 3, 3, 4, 0, 0, 0]
    assert (first["block_tables"][5:] == -1).all() and (first["temperature"][5:] == 0).all()
    # the same step decodes the four short prompts; the long one prefills on meanwhile
    assert [n for n, _ in model.calls[1:3]] == ["decode_4x1_c32", "prefill_1x16_c32"]


def test_packed_prefill_picks_the_smallest_buckets() -> None:
    engine, model = llm(prefill_batch=(1, 4, 8))
    prompts = [[1, 2, 3], [4, 5], [6]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=3, **GREEDY))
    assert [s.output_ids for s in outs] == [oracle(p, 3) for p in prompts]
    name, meta = model.calls[0]
    assert name == "prefill_4x8_c32"  # 3 sequences, 6 tokens
    assert list(meta["slot_mapping"][0, 6:]) == [-1, -1] and meta["context_lens"][3] == 0


def test_a_prompt_wanting_prompt_logprobs_prefills_alone() -> None:
    """Packed prefill graphs return no prompt logprobs (they are built for one-sequence
    graphs): such a prompt is never packed, and the others pack without it."""
    from neffkit.contract.records import BucketLists
    from neffkit.runtime.engine.scheduler import Scheduler
    from neffkit.runtime.worker.batch import SequenceState
    from tests.fake_model import scheduler_config

    buckets = BucketLists((8, 16), (1, 4), (32, 64), prefill_batch=(1, 4))
    layout = scheduler_config(8, 33, buckets, max_logprobs=5, prompt_logprobs=True)
    sched = Scheduler(layout)
    echo = SamplingParams(max_tokens=1, prompt_logprobs=1, **GREEDY)
    plain = SamplingParams(max_tokens=1, **GREEDY)
    seqs = [
        SequenceState(i, [1, 2, 3], p, seed=0) for i, p in enumerate([plain, echo, plain, plain])
    ]
    for seq in seqs:
        sched.add(seq)
    sched.admit()
    batch = sched.next_prefill()
    assert [c.seq for c in batch.chunks] == [seqs[0], seqs[2], seqs[3]] and batch.batch == 4
    sched.prefilling.remove(seqs[0])
    batch = sched.next_prefill()
    assert [c.seq for c in batch.chunks] == [seqs[1]] and batch.batch == 1


def test_engines_in_turn_on_one_runner_do_not_share_request_ids() -> None:
    """The runner's decode buffers know rows by request id: a second engine on the same loaded
    bundle must not reuse the first one's ids (its rows would keep the first's block tables)."""
    runner, _ = fake_runner()
    params = SamplingParams(max_tokens=6, **GREEDY)
    first = EngineCore(runner)
    a = first.add_request([1, 2, 3], params)
    drain(first)
    second = EngineCore(runner)
    second.scheduler.allocator.allocate(5)  # its sequences get other blocks than the first's
    b = second.add_request([4, 5, 6], params)
    drain(second)
    assert a.request_id != b.request_id
    assert a.output_ids == oracle([1, 2, 3], 6) and b.output_ids == oracle([4, 5, 6], 6)


class OneSlot:
    """An adapter pool with one slot (engine/adapters.py's contract, no tensors)."""

    def __init__(self) -> None:
        self.holder: str | None = None
        self.users = 0
        self.acquired: list[str] = []

    def acquire(self, seq) -> bool:
        if self.users and self.holder != seq.adapter_key:
            return False
        self.holder, self.users = seq.adapter_key, self.users + 1
        seq.lora_slot = 1
        self.acquired.append(seq.adapter_key)
        return True

    def release(self, seq) -> None:
        if seq.lora_slot:
            self.users -= 1
            seq.lora_slot = 0


def test_a_request_waits_for_an_adapter_slot_and_those_behind_it_go_on() -> None:
    runner, _ = fake_runner()
    core = EngineCore(runner)
    pool = core.scheduler.adapters = OneSlot()
    params = SamplingParams(max_tokens=6, **GREEDY)
    first = core.add_request([1, 2, 3], params)
    second = core.add_request([4, 5, 6], params)
    base = core.add_request([7, 8, 9], params)
    first.adapter_key, second.adapter_key = "a#1", "b#2"
    core.step()
    assert first.lora_slot == 1 and base.blocks  # the base request passed the waiting one
    assert not second.blocks and list(core.scheduler.waiting) == [second]
    drain(core, until=lambda: first.finished)
    assert pool.users == 0 and first.lora_slot == 0  # released with its blocks
    drain(core)
    assert pool.acquired == ["a#1", "b#2"] and second.output_ids == oracle([4, 5, 6], 6)
    assert [s.lora_slot for s in (first, second, base)] == [0, 0, 0]
