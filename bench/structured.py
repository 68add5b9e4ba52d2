"""What structured outputs cost a decode step: the token bitmask, penalty and logit-bias inputs in
the graphs (rows that use none of them), and rows that follow a JSON schema (llguidance fills
their masks on the host every step, the graph applies them).

The 125M benchmark shape (bench/batch.py: hidden 1024, 6 layers) with SmolLM2-135M-Instruct's
49152-token vocabulary and tokenizer (a grammar needs a real tokenizer; `make demo` converts it),
so 142M parameters, float32, built twice from one checkpoint: with the logit inputs (the
default) and without (`sampling: {structured: false, max_penalty_tokens: 0,
max_logit_bias: 0}`). Decode steps at batch 1 and 8 after a 32-token prompt, whole engine steps
(host work included), the three cases alternating for --rounds rounds; medians. Writes
bench/results/structured.json.

    .venv/bin/python bench/structured.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch import SHAPE  # noqa: E402
from common import REPO, ensure_bundle, median, parse_args, write_result  # noqa: E402

WORK = REPO / "bench" / "work" / "structured"
TOKENIZER = REPO / "models" / "smollm2-135m-instruct"
VOCAB = 49152
MANIFEST = """neffkit: 1
name: structured-{label}
model: {model}
dtype: float32
buckets: {{prefill: [32], decode: [1, 8], context: [256]}}
sampling: {sampling}
"""
SAMPLING = {
    "with": "{max_top_k: 64}",
    "without": "{max_top_k: 64, structured: false, max_penalty_tokens: 0, max_logit_bias: 0}",
}
# an answer that cannot end within the steps measured: the masks stay live throughout
SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "string", "minLength": 1000}},
    "required": ["notes"],
}


def checkpoint() -> Path:
    out = WORK / "llama-125m-v49k"
    if not (out / "config.json").exists():
        import transformers

        if not (TOKENIZER / "tokenizer.json").exists():
            sys.exit(f"{TOKENIZER} is missing: `make demo` converts SmolLM2-135M-Instruct")
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**{**SHAPE, "vocab_size": VOCAB})
        transformers.LlamaForCausalLM(config).save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(TOKENIZER / name, out / name)
    return out


def bundle(label: str) -> Path:
    WORK.mkdir(parents=True, exist_ok=True)
    manifest = WORK / f"structured-{label}.yaml"
    manifest.write_text(MANIFEST.format(label=label, model=checkpoint(), sampling=SAMPLING[label]))
    return ensure_bundle(manifest, WORK / f"bundle-{label}")


def step_times(loaded, batch: int, steps: int, constrained: bool) -> list[float]:
    """Engine steps once every row decodes (their prompts prefilled first, not timed)."""
    import time

    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.engine.loading import grammars_of
    from neffkit.runtime.sampling_params import SamplingParams, StructuredSpec

    spec = StructuredSpec("json", json.dumps(SCHEMA), any_whitespace=False)
    # rows prefill one a step, so the first ones decode a few tokens before the last starts
    params = SamplingParams(
        max_tokens=steps + batch + 4,
        temperature=0.0,
        ignore_eos=True,
        structured=spec if constrained else None,
    )
    core = EngineCore(loaded.runner, prefix_caching=False, grammars=grammars_of(loaded))
    rng = np.random.default_rng(batch)
    seqs = [core.add_request(rng.integers(100, VOCAB, 32).tolist(), params) for _ in range(batch)]
    while any(not s.output_ids for s in seqs):
        core.step()
    times = []
    while len(times) < steps:
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
        assert not any(s.finished for s in seqs), "a row ended early"
    for s in seqs:
        core.abort(s)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=9)
    args = parse_args(parser)
    from neffkit.runtime.engine.loading import load

    loaded = {label: load(bundle(label)) for label in SAMPLING}
    cases = {
        "plain graphs": ("without", False),
        "logit inputs, unconstrained": ("with", False),
        "logit inputs, JSON schema": ("with", True),
    }
    rows = []
    for batch in (1, 8):
        samples: dict[str, list[float]] = {name: [] for name in cases}
        ratios: dict[str, list[float]] = {"inputs": [], "schema": []}
        for label, constrained in cases.values():  # warm-up
            step_times(loaded[label], batch, 8, constrained)
        for _ in range(args.rounds):
            per_round = {}
            for name, (label, constrained) in cases.items():
                times = step_times(loaded[label], batch, args.steps, constrained)
                samples[name] += times
                per_round[name] = median(times)
            plain, inputs, masked = per_round.values()
            ratios["inputs"].append(inputs / plain)
            ratios["schema"].append(masked / inputs)
        ms = {name: round(1000 * median(v), 3) for name, v in samples.items()}
        inputs, schema = median(ratios["inputs"]), median(ratios["schema"])
        rows.append(
            {
                "batch": batch,
                "ms_per_step": ms,
                "unconstrained_rows_with_inputs_vs_plain": round(inputs, 4),
                "json_schema_rows_vs_unconstrained": round(schema, 4),
                "per_round": {k: [round(r, 4) for r in v] for k, v in ratios.items()},
            }
        )
        steps = ", ".join(f"{k} {v} ms" for k, v in ms.items())
        print(f"batch {batch}: {steps}; inputs {inputs:.3f}x plain, schema {schema:.3f}x")
    write_result(
        "structured",
        {
            "model": f"random Llama, bench/batch.py's shape with a {VOCAB}-token vocabulary and "
            "SmolLM2-135M-Instruct's tokenizer (142M parameters), float32",
            "method": f"engine steps after a 32-token prompt, {args.steps} steps x {args.rounds} "
            "rounds, cases alternating; ratios: the median of each round's ratio of "
            "median steps; JSON-schema rows: every row constrained "
            "(compact JSON, a string of at least 1000 characters: never complete)",
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
