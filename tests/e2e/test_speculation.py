"""Speculative decoding on compiled bundles: verify graphs built, recorded and audited; outputs
equal to the same bundle decoding plainly (tokens, logprobs within fp32 tolerance) at batch 1
and batch 4 with stops and max_tokens inside accepted runs; seeded sampling identical; the
verify graphs lowered for neuron and run on XLA:CPU with HF's tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.bundles import build_session_bundle, lowered_build, prebuild
from tests.support.cache import cached_dir
from tests.support.cli import run_cli, run_json
from tests.support.models import LEAN_SAMPLING, model_digest

SPEC = {"method": "ngram", "num_tokens": 3}
BUCKETS = {"prefill": [16], "decode": [1, 4], "context": [64]}
DRAFT_TOOL = REPO / "tools" / "draft_from_layers.py"


def draft_dir(hf_model_dir) -> Path:
    """The test llama's first layer with its embeddings, norm and head (tools/
    draft_from_layers.py): a draft that agrees with the target on some tokens, not all."""
    import hashlib
    import subprocess
    import sys

    digest = hashlib.sha256((model_digest("llama") + DRAFT_TOOL.read_text()).encode()).hexdigest()
    source = hf_model_dir("llama")
    return cached_dir(
        f"models/llama-draft1-{digest[:16]}",
        lambda out: subprocess.run(
            [sys.executable, str(DRAFT_TOOL), str(source), "--layers", "1", "-o", str(out)],
            check=True,
            capture_output=True,
        ),
    )


# the llama bundle's sampler and KV cache: its prefill and decode graphs are the llama bundle's
# (cache hits), only the verify graphs are compiled for it
@prebuild("llama_spec", stage=1)
def build_spec_bundle(session_dir: Path, hf_model_dir) -> Path:
    return build_session_bundle(
        session_dir,
        hf_model_dir("llama"),
        "llama_spec",
        buckets=BUCKETS,
        speculation=SPEC,
        sampling=LEAN_SAMPLING,
    ).bundle


@prebuild("llama_draft", stage=2)  # its target graphs are llama_spec's
def build_draft_bundle(session_dir: Path, hf_model_dir) -> Path:
    spec = {"method": "draft", "num_tokens": 3, "model": str(draft_dir(hf_model_dir))}
    return build_session_bundle(
        session_dir,
        hf_model_dir("llama"),
        "llama_draft",
        buckets=BUCKETS,
        speculation=spec,
        sampling=LEAN_SAMPLING,
    ).bundle


@pytest.fixture(scope="module")
def draft_bundle(session_dir: Path, hf_model_dir) -> Path:
    return build_draft_bundle(session_dir, hf_model_dir)


@pytest.fixture(scope="module")
def spec_bundle(session_dir: Path, hf_model_dir) -> Path:
    return build_spec_bundle(session_dir, hf_model_dir)


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(4, 30))] for _ in range(n)]


def reference_proposer(references: dict[tuple[int, ...], list[int]], wrong: float, seed: int):
    """Drafts from each prompt's plain greedy continuation, one of them wrong with probability
    `wrong`: runs of accepted drafts, rejections at every position, and (for sampled rows)
    mostly rejections. A random model does not repeat itself, so prompt lookup would propose
    little; the verify graphs and the scheduler are what these tests drive."""
    rng = random.Random(seed)

    def propose(tokens: list[int], k: int) -> list[int]:
        for prompt, out in references.items():
            if (
                tuple(tokens[: len(prompt)]) == prompt
                and tokens[len(prompt) :] == out[: len(tokens) - len(prompt)]
            ):
                drafts = list(out[len(tokens) - len(prompt) :][:k])
                if drafts and rng.random() < wrong:
                    drafts[rng.randrange(len(drafts))] = rng.randrange(3, 1000)
                return drafts
        return []

    return propose


def _generate(core, prompts, params, together: bool):
    """Each prompt alone (batch 1) or all queued at once (batches of up to 4)."""
    seqs = []
    for prompt, p in zip(prompts, params, strict=True):
        seqs.append(core.add_request(prompt, p))
        while not together and core.has_work():
            core.step()
    while core.has_work():
        core.step()
    return seqs


def _references(loaded, prompts):
    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.sampling_params import SamplingParams

    free = [
        SamplingParams(max_tokens=64 - len(p) - 1, temperature=0.0, ignore_eos=True)
        for p in prompts
    ]
    seqs = _generate(EngineCore(loaded.runner, speculation=False), prompts, free, True)
    return {tuple(p): s.output_ids for p, s in zip(prompts, seqs, strict=True)}


def _random_workload(loaded, together: bool):
    """200 prompts, their plain greedy continuations, and requests whose stops and max_tokens
    fall inside them (so inside accepted runs); a fifth sampled with seeds."""
    from neffkit.runtime.sampling_params import SamplingParams

    rng = random.Random(7)
    prompts = _prompts(seed=int(together), n=200)
    references = _references(loaded, prompts)
    params = []
    for prompt in prompts:
        out = references[tuple(prompt)]
        sampled = rng.random() < 0.2
        params.append(
            SamplingParams(
                max_tokens=rng.randint(1, len(out)),
                logprobs=2,
                ignore_eos=True,
                stop_token_ids=(out[rng.randrange(len(out))],) if rng.random() < 0.4 else (),
                temperature=0.8 if sampled else 0.0,
                seed=rng.randrange(10**6) if sampled else None,
            )
        )
    return prompts, references, params


def _assert_equal_outputs(params, with_spec, plain) -> None:
    """Greedy rows token for token (logprobs within 1e-4); seeded rows at least 95%."""
    same_sampled = []
    for p, a, b in zip(params, with_spec, plain, strict=True):
        if p.temperature > 0:  # an inverse-CDF draw can land on either side of a boundary
            same_sampled.append(a.output_ids == b.output_ids)  # the graphs' logits move by 1e-6
            continue
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        assert len(a.output_ids) <= p.max_tokens
        for la, lb in zip(a.output_logprobs, b.output_logprobs, strict=True):
            assert la.top_ids == lb.top_ids
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
    assert sum(same_sampled) >= 0.95 * len(same_sampled)


@pytest.mark.parametrize("together", [False, True], ids=["batch1", "batch4"])
def test_outputs_equal_plain_decoding(spec_bundle, together):
    """200 requests through the verify graphs with drafts from the plain continuations (30% with
    a wrong token): outputs equal plain decoding's."""
    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.engine.loading import load

    loaded = load(spec_bundle)
    prompts, references, params = _random_workload(loaded, together)
    spec_core = EngineCore(loaded.runner, proposer=reference_proposer(references, 0.3, 1))
    with_spec = _generate(spec_core, prompts, params, together)
    plain = _generate(EngineCore(loaded.runner, speculation=False), prompts, params, together)
    _assert_equal_outputs(params, with_spec, plain)
    counts = spec_core.scheduler.spec
    assert counts.drafts > 300 and counts.accepted_tokens > counts.drafts  # long runs accepted
    assert all(n > 0 for n in counts.accepted_per_position)


def test_sampled_tokens_are_distributed_as_plain_sampling(spec_bundle):
    """Temperature 1 over the whole vocabulary: the token after a verified draft, from 400
    seeds with speculation and 400 other seeds without, are one distribution (chi-square test
    of homogeneity over the 8 most frequent tokens and the rest)."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.sampling_params import SamplingParams

    loaded = load(spec_bundle)
    prompt = [11, 500, 42, 7, 300]
    references = _references(loaded, [prompt])
    spec = EngineCore(loaded.runner, proposer=reference_proposer(references, 0.0, 0))
    plain = EngineCore(loaded.runner, speculation=False)
    draws = {}
    for name, core, first in (("spec", spec, 0), ("plain", plain, 10_000)):
        params = [
            SamplingParams(max_tokens=3, temperature=1.0, seed=first + i, ignore_eos=True)
            for i in range(400)
        ]
        seqs = _generate(core, [prompt] * 400, params, True)
        draws[name] = Counter(s.output_ids[1] for s in seqs)
    assert spec.scheduler.spec.drafts > 0
    top = [t for t, _ in (draws["spec"] + draws["plain"]).most_common(8)]
    table = [
        [d[t] for t in top] + [sum(d.values()) - sum(d[t] for t in top)]
        for d in (draws["spec"], draws["plain"])
    ]
    assert chi2_contingency(table).pvalue > 0.001, table


def test_verify_graphs_are_recorded_audited_and_reported(spec_bundle, hf_model_dir, hf_greedy):
    record = json.loads((spec_bundle / "bundle.json").read_text())
    names = [g["name"] for g in record["graphs"]]
    assert {"verify_b1_k3_c64", "verify_b4_k3_c64"} <= set(names)
    assert record["layout"]["speculation"]["num_tokens"] == 3
    verify = next(g for g in record["graphs"] if g["name"] == "verify_b4_k3_c64")
    assert len(verify["io_alias"]) == 4  # K and V of both layers, updated in place
    inspect = run_cli("inspect", str(spec_bundle), check=True).stdout
    assert "verify_b4_k3_c64" in inspect and "speculation ngram" in inspect
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    report = run_json(
        "run",
        str(spec_bundle),
        "--max-tokens",
        "20",
        "--ignore-eos",
        "--prompt-ids",
        ",".join(map(str, prompt)),
    )
    assert report["outputs"][0]["token_ids"] == hf_greedy(hf_model_dir("llama"), prompt, 20)
    spec = report["speculation"]
    assert set(spec) >= {"drafts", "draft_tokens", "accepted_tokens", "mean_acceptance_length"}
    off = run_json(
        "run",
        str(spec_bundle),
        "--max-tokens",
        "20",
        "--ignore-eos",
        "--no-speculation",
        "--prompt-ids",
        ",".join(map(str, prompt)),
    )
    assert off["speculation"] is None and off["timings"]["verify_steps"] == 0


def test_verify_graphs_lower_for_neuron_and_run_on_xla_cpu(session_dir, hf_model_dir, hf_greedy):
    bundle = lowered_build(
        session_dir,
        hf_model_dir("llama"),
        "llama_spec_neuron",
        "--lower-only",
        buckets={"prefill": [16], "decode": [1], "context": [64]},
        speculation=SPEC,
    )
    findings = json.loads(run_cli("inspect", str(bundle), "--json").stdout)["findings"]
    assert [f for f in findings if f["severity"] == "error"] == []
    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.sampling_params import SamplingParams

    prompts = [[9, 8, 7, 9, 8, 7, 9, 8], [100, 200, 300]]
    expected = {tuple(p): hf_greedy(hf_model_dir("llama"), p, 16) for p in prompts}
    loaded = load(bundle, executor="xla-cpu")
    core = EngineCore(loaded.runner, proposer=reference_proposer(expected, 0.3, 2))
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * 2
    seqs = _generate(core, prompts, params, True)
    assert [s.output_ids for s in seqs] == [expected[tuple(p)] for p in prompts]
    assert loaded.runner.timings.verify_steps > 0 and core.scheduler.spec.accepted_tokens > 0


def test_server_streams_and_counts_speculation(spec_bundle):
    """Through the server and the openai client: the streamed text equals the offline run's, and
    /metrics carries vLLM's spec-decode counters."""
    from tests.e2e.test_server import _counter
    from tests.support.server import Server

    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5]
    alone = run_json(
        "run",
        str(spec_bundle),
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--prompt-ids",
        ",".join(map(str, prompt)),
    )["outputs"][0]
    server = Server(spec_bundle, "--served-model-name", "tiny")
    try:
        stream = server.client().completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == alone["text"]
        metrics = server.metrics()
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert _counter(metrics, f"vllm:spec_decode_{name}_total") >= 0
            assert f"vllm:spec_decode_{name}_total" in metrics
    finally:
        server.stop()


@pytest.mark.parametrize("together", [False, True], ids=["batch1", "batch4"])
def test_draft_model_outputs_equal_plain_decoding(draft_bundle, together):
    """The same 200-request workload with drafts from the draft model's own graphs (the target's
    first layer): outputs equal the same bundle decoding plainly; some drafts are accepted at
    every position, some rejected."""
    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.engine.loading import load

    loaded = load(draft_bundle)
    assert loaded.runner.draft is not None
    prompts, _, params = _random_workload(loaded, together)
    spec_core = EngineCore(loaded.runner)
    with_spec = _generate(spec_core, prompts, params, together)
    plain = _generate(EngineCore(loaded.runner, speculation=False), prompts, params, together)
    _assert_equal_outputs(params, with_spec, plain)
    counts = spec_core.scheduler.spec
    assert counts.drafts > 300 and 0 < counts.accepted_tokens < counts.draft_tokens
    assert all(n > 0 for n in counts.accepted_per_position)


def test_draft_model_bundle_is_recorded_verified_and_reported(
    draft_bundle, hf_model_dir, hf_greedy
):
    """The draft's bundle sits inside the target's, its files hashed into the target's record;
    `run --json` reports the draft's work; greedy tokens equal HF's; a changed draft file is
    caught when the bundle loads."""
    record = json.loads((draft_bundle / "bundle.json").read_text())
    assert record["layout"]["speculation"]["draft"] == "draft"
    assert "draft/bundle.json" in record["files"]
    draft = json.loads((draft_bundle / "draft" / "bundle.json").read_text())
    assert {g["name"] for g in draft["graphs"]} == {
        "prefill_t16_c64",
        "decode_b1_c64",
        "decode_b4_c64",
        "verify_b1_k3_c64",
        "verify_b4_k3_c64",
    }
    assert draft["model"]["num_layers"] == 1
    assert draft["layout"]["num_blocks"] == record["layout"]["num_blocks"]
    inspect = run_cli("inspect", str(draft_bundle), "--verify", check=True).stdout
    assert "speculation draft" in inspect
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    report = run_json(
        "run",
        str(draft_bundle),
        "--max-tokens",
        "20",
        "--ignore-eos",
        "--prompt-ids",
        ",".join(map(str, prompt)),
    )
    assert report["outputs"][0]["token_ids"] == hf_greedy(hf_model_dir("llama"), prompt, 20)
    assert report["speculation"]["draft_tokens"] > 0 and report["speculation"]["draft_calls"] > 0


@pytest.mark.full  # the draft on cpu and the verify graphs on XLA:CPU stay in `make test`
def test_draft_model_graphs_lower_for_neuron_and_run_on_xla_cpu(
    session_dir, hf_model_dir, hf_greedy
):
    """The target's and the draft's graphs lowered to HLO (the draft's bundle inside the
    target's), audited clean, run on XLA:CPU: greedy tokens equal HF's with drafts proposed."""
    spec = {"method": "draft", "num_tokens": 3, "model": str(draft_dir(hf_model_dir))}
    bundle = lowered_build(
        session_dir,
        hf_model_dir("llama"),
        "llama_draft_neuron",
        "--lower-only",
        buckets={"prefill": [16], "decode": [1], "context": [64]},
        speculation=spec,
    )
    for root in (bundle, bundle / "draft"):
        findings = json.loads(run_cli("inspect", str(root), "--json").stdout)["findings"]
        assert [f for f in findings if f["severity"] == "error"] == []
    assert (bundle / "draft" / "ir").is_dir()
    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.sampling_params import SamplingParams

    prompts = [[9, 8, 7, 9, 8, 7, 9, 8], [100, 200, 300]]
    loaded = load(bundle, executor="xla-cpu")
    core = EngineCore(loaded.runner)
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * 2
    seqs = _generate(core, prompts, params, True)
    assert [s.output_ids for s in seqs] == [
        hf_greedy(hf_model_dir("llama"), p, 16) for p in prompts
    ]
    assert loaded.runner.timings.verify_steps > 0 and core.scheduler.spec.draft_tokens > 0
