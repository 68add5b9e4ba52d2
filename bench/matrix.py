"""TTFT / TPOT matrix, batch 1: random prompts, 128 output tokens, ignore_eos, greedy.

The method of the vllm-neuron project's TTFT/TPOT bench: for each input length, time to the
first token (prefill, chunked through the prefill bucket) and time per output token after it,
medians over a few prompts. Input lengths are scaled to this machine and to the demo model.

    python bench/matrix.py [--inputs 64 128 256 512] [--prompts 3]
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

WORK = REPO / "bench" / "work"
OUTPUT = 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--prompts", type=int, default=3)
    args = parse_args(ap)
    WORK.mkdir(parents=True, exist_ok=True)
    contexts = sorted({max(256, 1 << (n + OUTPUT - 1).bit_length()) for n in args.inputs})
    blocks = contexts[-1] // 16 + 1
    manifest = WORK / "matrix.yaml"
    manifest.write_text(
        f"neffkit: 1\nname: demo-matrix\nmodel: {REPO / 'models' / 'demo-llama'}\n"
        f"dtype: float32\nkv_cache: {{block_size: 16, num_blocks: {blocks}}}\n"
        f"buckets: {{prefill: [128], decode: [1], context: {contexts}}}\n"
        "sampling: {max_top_k: 64}\n"
    )
    bundle = ensure_bundle(manifest, WORK / "matrix-bundle")

    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.sampling_params import SamplingParams

    llm = LLM(load(bundle))
    engine = llm.core
    rng = random.Random(0)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    rows = []
    for n in args.inputs:
        ttfts, tpots = [], []
        for _ in range(args.prompts):
            prompt = [rng.randrange(3, 1000) for _ in range(n)]
            seq = engine.add_request(
                prompt, SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True)
            )
            t0 = time.perf_counter()
            while not seq.output_ids:
                engine.step()
            first = time.perf_counter()
            while engine.has_work():
                engine.step()
            end = time.perf_counter()
            ttfts.append(first - t0)
            tpots.append((end - first) / (OUTPUT - 1))
        row = {
            "input": n,
            "ttft_ms": 1e3 * statistics.median(ttfts),
            "tpot_ms": 1e3 * statistics.median(tpots),
        }
        rows.append(row)
        print(f"input {n:>5}: TTFT {row['ttft_ms']:8.2f} ms   TPOT {row['tpot_ms']:.3f} ms")
    print(f"written {write_result('matrix', {'output': OUTPUT, 'rows': rows})}")


if __name__ == "__main__":
    main()
