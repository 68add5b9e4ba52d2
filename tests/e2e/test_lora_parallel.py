"""Adapters across ranks: each rank's slots hold its cut of A or B (as its projection is cut), the
leader tells the other ranks' processes which adapter to write where; lowered to HLO and run on
XLA:CPU. Equal to HF + peft."""

from __future__ import annotations

import pytest

from neffkit.runtime.engine.llm import LLM
from neffkit.runtime.sampling_params import SamplingParams
from neffkit.runtime.worker.loader import load
from tests.support.adapters import ATTENTION, build_moe_lora_lowered, make_adapters, peft_greedy
from tests.support.bundles import build_session_bundle
from tests.support.cli import run_ids
from tests.support.models import LONG, MAX_NEW, MIXED, SHORT

PROMPTS = [SHORT, LONG, *MIXED]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.mark.full
def test_tp2_ranks_write_their_cut_of_each_adapter(session_dir, hf_model_dir):
    """Two processes over gloo: the leader registers the adapter and broadcasts each slot write;
    the follower reads the adapter and writes its cut."""
    model = hf_model_dir("llama")
    bundle = build_session_bundle(
        session_dir,
        model,
        "llama_lora_tp2",
        buckets={"prefill": [16], "decode": [4], "context": [64]},
        parallel={"tp": 2},
        lora={"max_loras": 1, "max_rank": 16},
    ).bundle
    served = make_adapters(model)
    for name in ("all8", "mlp16"):
        got = run_ids(bundle, PROMPTS, MAX_NEW, "--lora", f"{name}={served[name]}")
        assert got == peft_greedy(model, served[name], PROMPTS, MAX_NEW), name


def test_moe_attention_adapters_at_tp2_lowered_on_xla_cpu(session_dir, hf_model_dir):
    """A mixture of experts (attention-only adapters), at tp=2 with ep=2 (each rank's cut of A
    or B), lowered to HLO and run on XLA:CPU, every rank in this process: equal to HF + peft."""
    model = hf_model_dir("mixtral")
    lowered = build_moe_lora_lowered(session_dir, hf_model_dir)
    served = make_adapters(model, ATTENTION)
    llm = LLM(load(lowered, executor="xla-cpu"), lora_modules=served)
    names = [None, *ATTENTION]
    prompts = PROMPTS[:3]
    jobs = [(p, n) for p in prompts for n in names]
    seqs = llm.generate([p for p, _ in jobs], GREEDY, [n for _, n in jobs])
    want = {n: peft_greedy(model, served[n] if n else None, prompts, MAX_NEW) for n in names}
    assert [s.output_ids for s in seqs] == [want[n][prompts.index(p)] for p, n in jobs]
    assert len({tuple(want[n][1]) for n in names}) == 3
