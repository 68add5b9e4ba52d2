"""KV groups without graphs: how layers group and pools are sized (contract/kv_groups.py), and a
sequence's blocks in a sliding group as it advances, shares a prefix and is given back
(runtime/engine/group_blocks.py)."""

from __future__ import annotations

import pytest

from neffkit.contract.kv_groups import KVGroup, chunk_limit, first_live, plan_groups, size_groups
from neffkit.runtime.engine.group_blocks import NULL, GroupPools
from neffkit.runtime.engine.kv_blocks import extend_hashes
from neffkit.runtime.sampling_params import SamplingParams
from neffkit.runtime.worker.batch import SequenceState

BS, CONTEXT, CHUNK, WINDOW = 16, 1024, 64, 64


def test_layers_group_by_window_and_pools_hold_as_many_sequences():
    plan = plan_groups([WINDOW, None, WINDOW, 32], BS, CONTEXT, CHUNK)
    assert plan == [(None, (1,), 64), (32, (3,), 6), (WINDOW, (0, 2), 8)]
    groups = size_groups(plan, full_blocks=8 * 64 + 1, context_blocks=64)
    assert [g.num_blocks for g in groups] == [513, 8 * 6 + 1, 8 * 8 + 1]
    # a budget of layer-blocks split by need: 3 sequences need 3 x (64 + 6 + 2 x 8) = 258
    budget = size_groups(plan, full_blocks=0, context_blocks=64, budget_blocks=258)
    assert [g.num_blocks for g in budget] == [3 * 64 + 1, 3 * 6 + 1, 3 * 8 + 1]
    # a window whose blocks would cover the context saves nothing: it stays with the full layers
    assert plan_groups([960, None], BS, CONTEXT, CHUNK) == [(None, (0, 1), 64)]


def test_a_chunk_never_needs_more_than_a_sequences_blocks():
    bps = 8
    for start in range(0, 700, 5):
        n = min(CHUNK, chunk_limit(WINDOW, bps, start, BS))
        assert n >= 1
        last = (start + n - 1) // BS
        assert last - first_live(WINDOW, start, BS) + 1 <= bps, start


def _seq(tokens: list[int], request: int = 0) -> SequenceState:
    seq = SequenceState(request, tokens, SamplingParams(max_tokens=8), seed=0)
    extend_hashes(seq.block_hashes, tokens, BS)
    return seq


def _groups() -> GroupPools:
    return GroupPools([KVGroup((1,), None, 65, 64), KVGroup((0,), WINDOW, 17, 8)], BS, caching=True)


def _advance(kv: GroupPools, seq: SequenceState, upto: int) -> None:
    """Decode one token at a time up to `upto` tokens: trim, then take what the step needs."""
    for end in range(1, upto + 1):
        kv.trim(seq, end - 1)
        kv.grow(seq, kv.needs(seq.kv_blocks, end, end))
        held = [b for b in seq.kv_blocks[1] if b != NULL]
        assert len(held) <= 8 and len(seq.kv_blocks[0]) == -(-end // BS)


def test_a_sliding_group_gives_back_what_the_window_left():
    kv = _groups()
    seq = _seq(list(range(300)))
    kv.admit(seq, [], [0, 0])
    _advance(kv, seq, 300)
    first = first_live(WINDOW, 299, BS)  # position 236's block, 14
    assert seq.kv_blocks[1][:first] == [NULL] * first and NULL not in seq.kv_blocks[1][first:]
    assert kv.pools[1].num_free == 16 - (19 - first)
    kv.release(seq)
    assert [p.num_free for p in kv.pools] == [64, 16] and seq.kv_blocks == []


def test_a_prefix_longer_than_the_window_hits_on_the_blocks_inside_it():
    kv = _groups()
    prefix = list(range(1, 301))
    seq = _seq(prefix + [7])
    kv.admit(seq, [], [0, 0])
    _advance(kv, seq, 301)
    for i in range(len(seq.block_hashes)):
        kv.register(seq, i, seq.block_hashes[i])
    kv.release(seq)
    other = _seq(prefix + [9, 9])
    hits = kv.cached_prefix(other.block_hashes)
    # 18 full blocks; the sliding group holds only 14..17, the window at token 288
    assert len(hits[0]) == 18 and hits[1][:14] == [NULL] * 14 and NULL not in hits[1][14:]
    # a window block evicted: the hit stops before the first window that lacks a block
    kv.pools[1].allocate(kv.pools[1].num_free)
    assert kv.cached_prefix(other.block_hashes) == [[], []]


def test_a_bundle_groups_its_sliding_layers_unless_told_not_to(hf_model_dir, tmp_path):
    from neffkit.compile.layout import model_layout
    from neffkit.errors import ManifestError
    from neffkit.manifest import load_manifest
    from tests.support.models import write_manifest

    buckets = {"prefill": [16], "decode": [4], "context": [64]}
    path = write_manifest(tmp_path / "m.yaml", hf_model_dir("gemma3"), buckets=buckets)
    groups = model_layout(load_manifest(path), "cpu").kv_groups
    # the tiny Gemma 3: layer 0 slides over 8 tokens, layer 1 is full; 4 sequences' worth each
    assert [(g.layers, g.window, g.num_blocks) for g in groups] == [((1,), None, 17), ((0,), 8, 9)]
    kv = {"hybrid": False}
    path = write_manifest(tmp_path / "m.yaml", hf_model_dir("gemma3"), buckets=buckets, kv_cache=kv)
    assert model_layout(load_manifest(path), "cpu").kv_groups == ()
    path = write_manifest(tmp_path / "m.yaml", hf_model_dir("gemma3"), kv_cache={"hybrid": 1})
    with pytest.raises(ManifestError, match="kv_cache.hybrid: expected true or false"):
        load_manifest(path)


def test_admission_counts_what_prefilling_prompts_will_still_take():
    """A prompt takes its sliding blocks chunk by chunk: admission counts a 300-token prompt's
    window (8 blocks) and what the prompts already prefilling will still take."""
    kv = _groups()
    first = _seq(list(range(300)))
    kv.admit(first, [], [19, 4])  # its whole prompt in the full group, its first chunk's 4
    assert kv.peak_needs([], [19, 4], 300) == [19, 8]
    assert kv.peak_needs([], [19, 4], 300, [first]) == [19, 8 + 4]
    assert kv.peak_needs([], [2, 2], 20, [first]) == [2, 2 + 4]  # a short prompt: its 2


def test_a_draft_model_over_sliding_groups_is_refused_by_name(hf_model_dir, tmp_path):
    from neffkit.compile.layout import model_layout
    from neffkit.errors import ManifestError
    from neffkit.manifest import load_manifest
    from tests.support.models import write_manifest

    draft = {"method": "draft", "model": str(hf_model_dir("gemma3")), "num_tokens": 2}
    path = write_manifest(
        tmp_path / "m.yaml",
        hf_model_dir("gemma3"),
        buckets={"prefill": [16], "decode": [4], "context": [64]},
        speculation=draft,
    )
    with pytest.raises(ManifestError, match="speculation.method draft: a draft model over sliding"):
        model_layout(load_manifest(path), "cpu")
