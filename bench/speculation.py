"""Speculation on a real model: what a verify step costs next to a decode step, and decode
tokens/s with and without speculation on prompts that quote their input and on ones that do not.

    .venv/bin/python bench/speculation.py     # SmolLM2-135M-Instruct (make demo converts it)
    .venv/bin/python bench/speculation.py --draft    # with a draft model instead of n-grams

--draft: manifests/smollm2-draft.yaml, the draft being SmolLM2's own embeddings, first 6 layers,
final norm and head (tools/draft_from_layers.py, made here if missing; no training); decode
time counts the draft's proposing too, and a draft step's cost (catch-up + K - 1 decode steps)
is measured beside the verify step. Writes bench/results/speculation_draft.json.

manifests/smollm2-spec.yaml (float32, batch 1, K = 4). Step cost: one sequence of 200 tokens,
`runner.decode` against `runner.verify` with 4 drafts, alternating, medians of 40 each. Tokens/s:
each prompt through its chat template, greedy, up to 160 tokens, generated with speculation and
without, alternating, 3 rounds; decode tokens/s = tokens after the first / time in decode and
verify graphs; medians per prompt group. The outputs with and without speculation must be equal.
Writes bench/results/speculation.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, ensure_bundle, parse_args, write_result  # noqa: E402

TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
    "single step. All that glitters is not gold, and not all those who wander are lost."
)
CODE = "def add(a, b):\n    retrun a + b\n\n\ndef sub(a, b):\n    return a - b\n"
QUOTING = [
    f"Repeat the following text exactly: {TEXT}",
    f"Fix the typo in this code:\n{CODE}",
    f"Copy this sentence back to me, word for word: {TEXT[:90]}",
]
DRAFT = REPO / "models" / "smollm2-135m-instruct-draft6"
OPEN = [
    "What are the benefits of regular exercise?",
    "Explain how a rainbow forms.",
    "Give me three ideas for a weekend trip.",
]


def step_costs(loaded) -> dict[str, float]:
    from neffkit.runtime.sampling_params import SamplingParams
    from neffkit.runtime.worker.batch import DecodeBatch, SequenceState

    runner = loaded.runner
    bs = runner.config.block_size
    seq = SequenceState(
        -1, list(range(100, 300)), SamplingParams(max_tokens=16), seed=0, output_ids=[7]
    )
    seq.blocks = list(range(1, 2 + (seq.length + 8) // bs))
    plain, verify = DecodeBatch([seq], 1, 512), DecodeBatch([seq], 1, 512, [[11, 12, 13, 14]])
    times: dict[str, list[float]] = {"decode": [], "verify": []}
    for _ in range(5):
        runner.decode(plain), runner.decode(verify)  # warm-up
    for _ in range(40):
        for name, batch in (("decode", plain), ("verify", verify)):
            t0 = time.perf_counter()
            runner.decode(batch)
            times[name].append(time.perf_counter() - t0)
    decode, verify_ms = (1000 * statistics.median(times[k]) for k in ("decode", "verify"))
    return {
        "decode_step_ms": round(decode, 2),
        "verify_step_ms": round(verify_ms, 2),
        "verify_over_decode": round(verify_ms / decode, 3),
    }


def draft_step_ms(loaded) -> float:
    """A draft model's proposal for one sequence of 200 tokens: one catch-up call and K - 1
    decode steps (median of 40)."""
    from neffkit.runtime.sampling_params import SamplingParams
    from neffkit.runtime.worker.batch import SequenceState

    draft = loaded.runner.draft
    bs = loaded.runner.config.block_size
    seq = SequenceState(
        -1, list(range(100, 300)), SamplingParams(max_tokens=16), seed=0, output_ids=[7]
    )
    seq.blocks = list(range(1, 2 + (seq.length + 8) // bs))
    times = []
    for i in range(45):
        seq.drafting.computed, seq.drafting.speculated = seq.length - 1, []
        t0 = time.perf_counter()
        draft.propose([seq], [draft.k])
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 2)


def tokens_per_s(llm, prompt: list[int]) -> tuple[float, list[int]]:
    """Decode tokens/s: tokens after the first over the time in decode and verify graphs and,
    with a draft model, in its proposing."""
    from neffkit.runtime.sampling_params import SamplingParams

    t, draft = llm.loaded.runner.timings, llm.core.draft
    before = t.decode_s + (draft.propose_s if draft else 0.0)
    (seq,) = llm.generate([prompt], SamplingParams(max_tokens=160, temperature=0.0))
    spent = t.decode_s + (draft.propose_s if draft else 0.0) - before
    return (len(seq.output_ids) - 1) / spent, seq.output_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", action="store_true", help="a draft model instead of n-grams")
    args = parse_args(ap)
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load

    with_draft = args.draft
    name = "draft" if with_draft else "spec"
    if with_draft and not DRAFT.is_dir():
        tool = REPO / "tools" / "draft_from_layers.py"
        subprocess.run(
            [
                sys.executable,
                str(tool),
                str(DRAFT.parent / "smollm2-135m-instruct"),
                "--layers",
                "6",
                "-o",
                str(DRAFT),
            ],
            check=True,
        )
    bundle = ensure_bundle(
        REPO / "manifests" / f"smollm2-{name}.yaml",
        REPO / "bundles" / f"smollm2-135m-instruct-{name}",
    )
    loaded = load(bundle)
    tok = loaded.tokenizer
    costs = step_costs(loaded)
    if with_draft:
        costs["draft_step_ms"] = draft_step_ms(loaded)
        costs["draft"] = "SmolLM2-135M-Instruct's first 6 of 30 layers with its head (no training)"
    print(costs)
    groups: dict[str, dict[str, object]] = {}
    for group, questions in (("quoting", QUOTING), ("open", OPEN)):
        speedups, acceptance = [], []
        for q in questions:
            prompt = tok.encode_chat([{"role": "user", "content": q}])
            rates: dict[str, list[float]] = {"spec": [], "plain": []}
            for _ in range(3):
                # a fresh engine each run: two engines on one bundle share its KV cache, so one
                # must not keep cached prefixes the other overwrites
                spec = LLM(loaded)
                rate, with_spec = tokens_per_s(spec, prompt)
                rates["spec"].append(rate)
                rate, without = tokens_per_s(LLM(loaded, speculation=False), prompt)
                rates["plain"].append(rate)
                if with_spec != without:
                    raise SystemExit(f"speculation changed the output of {q!r}")
            speedups.append(statistics.median(rates["spec"]) / statistics.median(rates["plain"]))
            acceptance.append(spec.core.scheduler.spec.mean_acceptance_length)
        groups[group] = {
            "prompts": len(questions),
            "speedup_median": round(statistics.median(speedups), 3),
            "speedups": [round(s, 3) for s in speedups],
            "mean_acceptance_length": [round(a, 2) for a in acceptance],
        }
        print(group, groups[group])
    result = {"bundle": str(bundle.relative_to(REPO)), "num_tokens": 4, **costs, **groups}
    write_result("speculation_draft" if with_draft else "speculation", result)


if __name__ == "__main__":
    main()
