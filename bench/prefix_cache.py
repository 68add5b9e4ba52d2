"""Prefix caching on a real model: the time to first token of a question after a long shared
system prompt, on a cache hit against cold, alternating in one process.

    .venv/bin/python bench/prefix_cache.py     # SmolLM2-135M-Instruct (make demo converts it)

manifests/smollm2-long.yaml (float32, prefill chunks of 512 and 64, context 1,088). Each pair of
runs: a cold request (a system prompt of 1,024 tokens never seen before, then a 32-token
question: 1,056 tokens computed) and a hit (the shared system prompt, already cached, then a new
32-token question: 32 computed). TTFT = wall time of a request with max_tokens 1 through the
engine (`LLM.generate`: scheduling, prefill chunks, sampling). Medians; the greedy first tokens of
the hits are checked against the same requests with caching off. Writes
bench/results/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, ensure_bundle, parse_args, write_result  # noqa: E402

SYSTEM, QUESTION = 1024, 32


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=7)
    args = parse_args(parser)
    import torch

    from neffkit.runtime.engine.core import engine_threads
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.sampling_params import SamplingParams

    torch.set_num_threads(engine_threads())
    bundle = ensure_bundle(
        REPO / "manifests" / "smollm2-long.yaml", REPO / "bundles" / "smollm2-135m-instruct-long"
    )
    loaded = load(bundle)
    vocab = loaded.bundle.record.model.vocab_size
    llm, plain = LLM(loaded), LLM(loaded, prefix_caching=False)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(0)
    shared = _tokens(rng, SYSTEM, vocab)
    llm.generate([shared + _tokens(rng, QUESTION, vocab)], one)  # warm-up; caches `shared`
    cold, hit, hit_prompts, hit_tokens = [], [], [], []
    for _ in range(args.pairs):
        prompt = _tokens(rng, SYSTEM + QUESTION, vocab)  # a system prompt never seen before
        t0 = time.perf_counter()
        llm.generate([prompt], one)
        cold.append(time.perf_counter() - t0)
        prompt = shared + _tokens(rng, QUESTION, vocab)
        t0 = time.perf_counter()
        (seq,) = llm.generate([prompt], one)
        hit.append(time.perf_counter() - t0)
        assert seq.num_cached == SYSTEM, seq.num_cached
        hit_prompts.append(prompt)
        hit_tokens.append(seq.output_ids)
    same = [s.output_ids for s in plain.generate(hit_prompts, one)] == hit_tokens
    result = {
        "bundle": str(bundle.relative_to(REPO)),
        "system_prompt_tokens": SYSTEM,
        "question_tokens": QUESTION,
        "pairs": args.pairs,
        "ttft_cold_ms": round(1000 * statistics.median(cold), 1),
        "ttft_hit_ms": round(1000 * statistics.median(hit), 1),
        "speedup": round(statistics.median(cold) / statistics.median(hit), 2),
        "hit_tokens_equal_uncached": same,
    }
    print(result)
    write_result("prefix_cache", result)
    if not same:
        raise SystemExit("a hit's first token differs from the uncached request's")


if __name__ == "__main__":
    main()
