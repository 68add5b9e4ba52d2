"""Runtime behaviour: import isolation, requests that cannot fit, stopping, KV accounting."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support import REPO
from tests.support.cli import run_cli


def test_runtime_imports_no_compiler(bundle):
    code = f"""
import sys, json
from neffkit.runtime.engine.loading import load
from neffkit.runtime.sampling_params import SamplingParams
from neffkit.runtime.engine.llm import LLM
out = LLM(load({str(bundle("llama_tied"))!r})).generate([[1, 2, 3]], SamplingParams(max_tokens=3))
bad = [m for m in sys.modules if m.startswith(("neffkit.compile", "neffkit.models",
       "torch._dynamo", "torch._inductor"))]
print(json.dumps({{"bad": bad, "n": len(out[0].output_ids)}}))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"bad": [], "n": 3}


def test_request_beyond_largest_context_lists_buckets(bundle):
    prompt = ",".join(["5"] * 60)
    proc = run_cli("run", str(bundle("llama")), "--prompt-ids", prompt, "--max-tokens", "10")
    assert proc.returncode == 2
    assert "exceeds the largest context bucket (64)" in proc.stderr
    assert "context buckets: [64]" in proc.stderr and "Traceback" not in proc.stderr


def test_stop_tokens_and_kv_blocks_are_released(bundle):
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.sampling_params import SamplingParams

    engine = LLM(load(bundle("llama_tied")))
    sched = engine.core.scheduler
    free = sched.allocator.num_free
    (ref,) = engine.generate([[4, 5, 6]], SamplingParams(max_tokens=8, temperature=0.0))
    stop_at = ref.output_ids[3]
    first = ref.output_ids.index(stop_at)
    stop = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop_at,))
    (seq,) = engine.generate([[4, 5, 6]], stop)
    assert seq.output_ids == ref.output_ids[: first + 1] and seq.finish_reason == "stop"
    assert sched.allocator.num_free == free and sched.kv_usage == 0.0


def test_more_prompts_than_largest_decode_bucket(bundle, hf_model_dir, hf_greedy):
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.sampling_params import SamplingParams

    engine = LLM(load(bundle("llama_tied")))
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(6)]  # decode buckets are [1, 4]
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    for prompt, seq in zip(prompts, outs, strict=True):
        assert seq.output_ids == hf_greedy(hf_model_dir("llama_tied"), prompt, 6)


def test_decode_rows_taken_over_get_their_own_sampling_and_blocks(bundle, hf_model_dir, hf_greedy):
    """Decode metadata is updated in place: a row that passes to another sequence must not keep
    the previous one's temperature or block table. The sampled request finishes first, so the
    greedy ones move up into its row (and later into a smaller bucket); they must stay HF's."""
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.sampling_params import SamplingParams

    engine = LLM(load(bundle("llama_tied")))
    sampled = SamplingParams(max_tokens=2, temperature=5.0, top_k=0, seed=7, ignore_eos=True)
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    prompts = [[7, 8, 9], [40, 41, 42, 43], [50, 51]]
    outs = engine.generate(prompts, [sampled, greedy, greedy])
    assert len(outs[0].output_ids) == 2
    for prompt, seq in zip(prompts[1:], outs[1:], strict=True):
        assert seq.output_ids == hf_greedy(hf_model_dir("llama_tied"), prompt, 10)
    assert engine.core.scheduler.kv_usage == 0.0


def test_loading_leaves_no_unpacked_packages_behind(bundle, tmp_path):
    """AOTInductor unpacks each package under $TMPDIR; a run unpacks into one directory of its
    own and removes it at exit (the loader's own `aotinductor_*` directories were never removed)."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "neffkit",
            "run",
            str(bundle("llama")),
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "2",
            "--json",
        ],
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert list(tmp.iterdir()) == []


def test_every_graph_pays_its_first_call_at_load(bundle, hf_model_dir, hf_greedy):
    """A bundle's graphs run once on padding while it loads (runner.warm_up), so the first
    request's prefill is not where their first calls' costs land; `run --json` reports that
    share of the load apart, and the greedy tokens that follow are HF's (the warm-up wrote
    nothing where a sequence reads)."""
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.sampling_params import SamplingParams

    loaded = load(bundle("llama"))
    assert 0 < loaded.warm_up_seconds < loaded.load_seconds
    called: list[str] = []
    for graph in loaded.runner.graph_list:
        object.__setattr__(graph, "run", _counted(graph.name, graph.run, called))
    loaded.runner.warm_up()
    assert sorted(called) == sorted(g.name for g in loaded.runner.graph_list)
    prompts = [[5, 6, 7], [8, 9]]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    got = [s.output_ids for s in LLM(loaded).generate(prompts, params)]
    assert got == [hf_greedy(hf_model_dir("llama"), p, 8) for p in prompts]
    args = ("run", str(bundle("llama")), "--prompt-ids", "5,6,7", "--max-tokens", "2", "--json")
    timings = json.loads(run_cli(*args, check=True).stdout)["timings"]
    assert 0 < timings["warm_up_s"] < timings["load_s"]


def _counted(name, run, called: list[str]):
    def counted(meta):
        called.append(name)
        return run(meta)

    return counted
