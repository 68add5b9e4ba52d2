"""KV groups on compiled bundles: a sliding-window layer's cache is window-sized in the graphs,
and the tokens stay HF's. Gemma 3 (a sliding and a full layer), Mistral (every layer slides) and
GPT-OSS (sliding and full, with sinks), each the tiny test checkpoint with a window of 64 at
context 1024: prompts from 20 to 900 tokens, 16 at once, a cached prefix longer than the window,
and a sliding pool small enough that prefill chunks preempt."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from tests.support.bundles import build_session_bundle
from tests.support.cli import run_json
from tests.support.models import LEAN_SAMPLING

WINDOW, CHUNK, BLOCK = 64, 64, 16
BUCKETS = {"prefill": [CHUNK], "decode": [8], "context": [1024]}
KINDS = ("gemma3", "mistral", "gpt_oss")
PREFIX = [random.Random(7).randrange(3, 1000) for _ in range(300)]


@pytest.fixture(scope="module")
def windowed(session_dir, hf_model_dir):
    """kind → (its checkpoint with window 64 and 1024 positions, its bundle)."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(kind: str) -> tuple[Path, Path]:
        if kind not in made:
            model = session_dir / f"{kind}_w{WINDOW}"
            if not model.exists():
                shutil.copytree(hf_model_dir(kind), model)
                config = json.loads((model / "config.json").read_text())
                config |= {"sliding_window": WINDOW, "max_position_embeddings": 1024}
                (model / "config.json").write_text(json.dumps(config))
            built = build_session_bundle(
                session_dir, model, f"{kind}_w{WINDOW}", buckets=BUCKETS, sampling=LEAN_SAMPLING
            )
            made[kind] = (model, built.bundle)
        return made[kind]

    return get


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


@pytest.mark.parametrize("kind", KINDS)
def test_sliding_caches_are_window_sized_in_the_graphs(kind, windowed):
    _, bundle = windowed(kind)
    record = json.loads((bundle / "bundle.json").read_text())
    groups = record["layout"]["kv_groups"]
    sliding = [g for g in groups if g["window"] == WINDOW]
    assert sliding and all(g["window"] in (None, WINDOW) for g in groups)
    seqs = BUCKETS["decode"][-1]  # the default pool: every decode row at the largest context
    for group in sliding:
        per_seq = (group["num_blocks"] - 1) * BLOCK / seqs
        assert per_seq <= WINDOW + max(BLOCK, CHUNK)
        for graph in record["graphs"]:
            shapes = {i["name"]: i["shape"] for i in graph["inputs"]}
            for layer in group["layers"]:
                assert shapes[f"k_cache.{layer}"][0] == group["num_blocks"], graph["name"]
    report = run_json("inspect", str(bundle))
    assert [g["window"] for g in report["kv_cache"]["groups"]] == [g["window"] for g in groups]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_hf_from_20_to_900_tokens_16_at_once(kind, windowed, hf_greedy):
    model, bundle = windowed(kind)
    prompts = [_prompt(n, n) for n in (20, 300, 900)]
    prompts += [_prompt(20 + 57 * i, 100 + i) for i in range(13)]  # 16 in all
    args = ["run", str(bundle), "--max-tokens", "6"]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    outputs = run_json(*args)["outputs"]
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out["token_ids"] == hf_greedy(model, prompt, 6), (kind, len(prompt))


def _engine(bundle: Path, caching: bool = True, blocks: int | None = None):
    from neffkit.runtime.config import SchedulingOptions
    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.engine.loading import load

    scheduling = SchedulingOptions(num_blocks=blocks)
    return EngineCore(load(bundle).runner, prefix_caching=caching, scheduling=scheduling)


def _generate(
    core, prompts: list[list[int]], seeded: bool = False, at_once: bool = True, tokens: int = 8
):
    from neffkit.runtime.sampling_params import SamplingParams

    def params(i: int) -> SamplingParams:
        if seeded and i % 2:
            return SamplingParams(max_tokens=tokens, temperature=0.8, seed=i, ignore_eos=True)
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    seqs = []
    for i, prompt in enumerate(prompts):
        seqs.append(core.add_request(prompt, params(i)))
        while core.has_work() and not at_once:
            core.step()
    while core.has_work():
        core.step()
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("kind", KINDS)
def test_a_prefix_longer_than_the_window_is_a_hit(kind, windowed, hf_greedy):
    """The second prompt shares 300 tokens (18 full blocks) with the first: the sliding group
    needs only the blocks inside the window at the suffix's start, so it is a hit; the tokens
    are HF's, and those of the same engine without the cache."""
    model, bundle = windowed(kind)
    first, second = PREFIX + _prompt(9, 1), PREFIX + _prompt(13, 2)
    core = _engine(bundle)
    _generate(core, [first])
    (cached,) = _generate(core, [second])
    assert core.scheduler.cache_hits >= 18 * BLOCK > WINDOW
    assert cached == hf_greedy(model, second, 8)
    assert _generate(_engine(bundle, caching=False), [second]) == [cached]


def test_sixteen_at_once_on_a_small_sliding_pool_equal_each_alone(windowed):
    """Mistral's only group slides: 20 blocks. Admission counts each prompt's window, but a
    prompt shorter than the window grows into it as it decodes (20 + 3i tokens, then 48), so
    decode steps and prefill chunks preempt; greedy and seeded requests equal each run alone."""
    _, bundle = windowed("mistral")
    prompts = [_prompt(20 + 3 * i, 200 + i) for i in range(16)]
    core = _engine(bundle, blocks=20)
    together = _generate(core, prompts, seeded=True, tokens=48)
    assert core.scheduler.preemptions > 0
    alone = _generate(_engine(bundle, blocks=20), prompts, seeded=True, at_once=False, tokens=48)
    assert together == alone
    assert core.scheduler.allocator.num_free == core.scheduler.allocator.num_usable
