"""Time to first token under a burst: N prompts arriving at once, packed prefill against one
prompt per step.

The 125M Llama of bench/batch.py (float32) built twice from one manifest that differs only in
`buckets.prefill_batch`: [1] (each step prefills one prompt) and [1, 8] (one call packs up to 8
prompts' tokens side by side). Both bundles are loaded in this process and timed in alternating
rounds: N prompts are queued at the same instant, the engine steps, and each request's TTFT is
when the step that produced its first token ended. Engine-level (no HTTP): what the scheduler and
the graphs cost, without the server's constant overhead. Medians over rounds of p50 / p99 (the
last of the N) TTFT. Writes bench/results/burst.json.

    .venv/bin/python bench/burst.py [--rounds 5] [--arrivals 1 8] [--prompt-len 4 16]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch import checkpoint  # noqa: E402
from common import REPO, ensure_bundle, median, parse_args, write_result  # noqa: E402

WORK = REPO / "bench" / "work" / "burst"
MANIFEST = """neffkit: 1
name: burst-{name}
model: {model}
dtype: float32
buckets: {{prefill: [32, 128], decode: [1, 4, 8], context: [256], prefill_batch: {batch}}}
"""
VARIANTS = {"one_per_step": [1], "packed": [1, 8]}


def bundle(name: str, batch: list[int]) -> Path:
    WORK.mkdir(parents=True, exist_ok=True)
    manifest = WORK / f"burst-{name}.yaml"
    manifest.write_text(MANIFEST.format(name=name, model=checkpoint(), batch=batch))
    return ensure_bundle(manifest, WORK / f"bundle-{name}")


def burst_ttft(engine: Any, prompts: list[list[int]]) -> list[float]:
    """Queue every prompt at once; step until each has its first token. Seconds per prompt."""
    from neffkit.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    core = engine.core
    t0 = time.perf_counter()
    seqs = [core.add_request(p, params) for p in prompts]
    first: dict[int, float] = {}
    while len(first) < len(seqs):
        core.step()
        now = time.perf_counter() - t0
        for seq in seqs:
            if seq.output_ids and seq.request_id not in first:
                first[seq.request_id] = now
                core.abort(seq)  # only the first token is timed; free its blocks
    while core.has_work():
        core.step()
    return [first[s.request_id] for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--arrivals", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[4, 16])
    args = parse_args(ap)

    from neffkit.runtime.engine.core import engine_threads
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load

    torch.set_num_threads(engine_threads())
    engines = {name: LLM(load(bundle(name, batch))) for name, batch in VARIANTS.items()}
    rng = random.Random(0)
    cases = [(n, length) for length in args.prompt_len for n in args.arrivals]
    prompts = {
        (n, length): [[rng.randrange(3, 32000) for _ in range(length)] for _ in range(n)]
        for n, length in cases
    }
    for engine in engines.values():  # page the weights in, warm every graph the cases use
        for case in cases:
            burst_ttft(engine, prompts[case])
    samples: dict[tuple[str, int, int], dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for case in cases:
            for name, engine in engines.items():  # alternate the bundles within each round
                ttft = sorted(burst_ttft(engine, prompts[case]))
                s = samples.setdefault((name, *case), {"p50": [], "p99": []})
                s["p50"].append(ttft[len(ttft) // 2])
                s["p99"].append(ttft[-1])
    rows = []
    for (name, n, length), s in samples.items():
        rows.append(
            {
                "variant": name,
                "prefill_batch": VARIANTS[name],
                "arrivals": n,
                "prompt_len": length,
                "ttft_p50_ms": 1000 * median(s["p50"]),
                "ttft_p99_ms": 1000 * median(s["p99"]),
            }
        )
        print(
            f"{name:>13}  {n} arrivals x {length:>2} tokens: TTFT p50 "
            f"{rows[-1]['ttft_p50_ms']:7.1f} ms, p99 {rows[-1]['ttft_p99_ms']:7.1f} ms"
        )
    path = write_result(
        "burst",
        {
            "model": "llama-125m (bench/batch.py)",
            "dtype": "float32",
            "rounds": args.rounds,
            "rows": rows,
        },
    )
    print(f"written {path}")


if __name__ == "__main__":
    main()
