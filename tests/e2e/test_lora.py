"""Multi-LoRA: one bundle with adapter slots serves the base and PEFT adapters mixed in one batch,
token for token as HF + peft (the oracle), with more adapters than slots, prefix caching and
n-gram speculation on."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from neffkit.errors import AdapterError, RequestError
from neffkit.runtime.engine.llm import LLM
from neffkit.runtime.sampling_params import SamplingParams
from neffkit.runtime.worker.loader import load
from tests.support import REPO
from tests.support.adapters import PROMPTS, REPEATS
from tests.support.cli import bundle_json, run_cli, run_ids
from tests.support.models import LONG, MAX_NEW, SHORT

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
# the fixtures lora_bundle, adapters and oracle are tests/e2e/conftest.py's


def _served(adapters: dict[str, Path]) -> dict[str, Path]:
    return {n: adapters[n] for n in ("attn4", "all8", "mlp16")}


@pytest.mark.parametrize("speculation", [False, True])
def test_mixed_batch_equals_hf_peft(lora_bundle, adapters, oracle, speculation):
    """28 requests at once: the base and three adapters (ranks 4, 8 and 16; attention, every
    projection, the MLP with rsLoRA) over two slots, so requests wait for a slot and slots are
    reused; every row equals HF + peft for its adapter."""
    llm = LLM(load(lora_bundle), speculation=speculation, lora_modules=_served(adapters))
    names = [None, "attn4", "all8", "mlp16"]
    jobs = [(p, n) for n in names for p in PROMPTS] + [(REPEATS, "all8")] * 4
    seqs = llm.generate([p for p, _ in jobs], GREEDY, [n for _, n in jobs])
    for (prompt, name), seq in zip(jobs, seqs, strict=True):
        assert seq.output_ids == oracle[name][PROMPTS.index(prompt)], (name, prompt)
    distinct = {tuple(oracle[n][1]) for n in names}
    assert len(distinct) == 4  # each adapter changes the tokens
    if speculation:
        assert llm.core.runner.timings.verify_steps > 0


def test_prefix_cache_keeps_adapters_apart(lora_bundle, adapters, oracle):
    """The same long prompt under the base, then an adapter, then the adapter again: the
    adapter's first run finds nothing cached (its blocks hash with its key), its second finds
    its own blocks; a re-registered name never reuses the old blocks."""
    llm = LLM(load(lora_bundle), lora_modules=_served(adapters))
    runs = [None, "all8", "all8"]
    cached = []
    for name in runs:
        (seq,) = llm.generate([LONG], GREEDY, name)
        assert seq.output_ids == oracle[name][1]
        cached.append(seq.num_cached)
    assert cached == [0, 0, 32]
    assert llm.adapters is not None
    llm.adapters.unregister("all8")
    llm.load_lora("all8", adapters["attn4"])  # the name, another adapter
    (seq,) = llm.generate([LONG], GREEDY, "all8")
    assert (seq.num_cached, seq.output_ids) == (0, oracle["attn4"][1])


def test_adapter_loaded_at_run_time_and_refusals(lora_bundle, adapters, oracle):
    llm = LLM(load(lora_bundle))
    llm.load_lora("late", adapters["mlp16"])
    seqs = llm.generate(PROMPTS, GREEDY, "late")
    assert [s.output_ids for s in seqs] == oracle["mlp16"]
    with pytest.raises(AdapterError, match="r 32 is above this bundle's lora.max_rank 16"):
        llm.load_lora("wide", adapters["wide32"])
    with pytest.raises(RequestError, match="adapter 'nope' is not loaded"):
        llm.generate([SHORT], GREEDY, "nope")
    assert llm.adapters is not None
    llm.adapters.unregister("late")
    with pytest.raises(RequestError, match="adapter 'late' is not loaded"):
        llm.generate([SHORT], GREEDY, "late")


def test_cli_generates_with_an_adapter(lora_bundle, adapters, oracle, bundle):
    got = run_ids(lora_bundle, PROMPTS, MAX_NEW, "--lora", f"attn4={adapters['attn4']}")
    assert got == oracle["attn4"]
    proc = run_cli("run", str(bundle("llama")), "--prompt-ids", "1,2", "--lora", "x=/nowhere")
    assert proc.returncode == 2
    assert "built without adapter slots" in proc.stderr and "Traceback" not in proc.stderr


def test_inspect_shows_the_slots(lora_bundle):
    report = json.loads(run_cli("inspect", str(lora_bundle), "--json", check=True).stdout)
    jsonschema.validate(report, json.loads((REPO / "docs" / "inspect.schema.json").read_text()))
    lora = report["layout"]["lora"]
    assert (lora["max_loras"], lora["max_rank"], len(lora["targets"])) == (2, 16, 2 * 7)
    graph = next(g for g in bundle_json(lora_bundle)["graphs"] if g["name"] == "decode_b4_c64")
    names = [i["name"] for i in graph["inputs"]]
    assert "lora_slots" in names and "model.layers.1.mlp.down_proj.lora_b" in names
    assert "2 LoRA slot(s) of rank up to 16" in run_cli("inspect", str(lora_bundle)).stdout
