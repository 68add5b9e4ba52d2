"""n-gram speculation on a real model: what a verify step costs next to a decode step, and decode
tokens/s with and without speculation on prompts that quote their input and on ones that do not.

    .venv/bin/python bench/speculation.py     # SmolLM2-135M-Instruct (make demo converts it)

manifests/smollm2-spec.yaml (float32, batch 1, K = 4). Step cost: one sequence of 200 tokens,
`runner.decode` against `runner.verify` with 4 drafts, alternating, medians of 40 each. Tokens/s:
each prompt through its chat template, greedy, up to 160 tokens, generated with speculation and
without, alternating, 3 rounds; decode tokens/s = tokens after the first / time in decode and
verify graphs; medians per prompt group. The outputs with and without speculation must be equal.
Writes bench/results/speculation.json.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, ensure_bundle, write_result  # noqa: E402

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
OPEN = [
    "What are the benefits of regular exercise?",
    "Explain how a rainbow forms.",
    "Give me three ideas for a weekend trip.",
]


def step_costs(loaded) -> dict[str, float]:
    from neffkit.runtime.sampling_params import SamplingParams
    from neffkit.runtime.scheduler import DecodeBatch, SequenceState

    runner = loaded.runner
    bs = runner.config.block_size
    seq = SequenceState(-1, list(range(100, 300)), SamplingParams(max_tokens=16), 0, [7])
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
    return {"decode_step_ms": round(decode, 2), "verify_step_ms": round(verify_ms, 2),
            "verify_over_decode": round(verify_ms / decode, 3)}  # fmt: skip


def tokens_per_s(llm, prompt: list[int]) -> tuple[float, list[int]]:
    from neffkit.runtime.sampling_params import SamplingParams

    t = llm.loaded.runner.timings
    before = t.decode_s
    (seq,) = llm.generate([prompt], SamplingParams(max_tokens=160, temperature=0.0))
    return (len(seq.output_ids) - 1) / (t.decode_s - before), seq.output_ids


def main() -> None:
    import torch

    from neffkit.runtime.core import engine_threads
    from neffkit.runtime.llm import LLM
    from neffkit.runtime.loader import load

    torch.set_num_threads(engine_threads())
    bundle = ensure_bundle(
        REPO / "manifests" / "smollm2-spec.yaml", REPO / "bundles" / "smollm2-135m-instruct-spec"
    )
    loaded = load(bundle)
    tok = loaded.tokenizer
    costs = step_costs(loaded)
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
    write_result("speculation", {"bundle": str(bundle.relative_to(REPO)), "num_tokens": 4,
                                 **costs, **groups})  # fmt: skip


if __name__ == "__main__":
    main()
