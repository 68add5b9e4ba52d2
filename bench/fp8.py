"""fp32, bf16 and block-fp8 weights of one 125M-parameter Llama, side by side in one run.

bench/batch.py's random checkpoint (hidden 1024, 6 layers, vocab 32000), quantized to DeepSeek's
block fp8 (128x128, tools/make_fp8_model.py; unquantized tensors in bfloat16). Reports weight bytes
per rank shard (what a decode step streams), batch-1 decode step time (median of alternating
rounds), and greedy agreement of the fp8 bundle with the unquantized fp32 one. Writes
bench/results/fp8.json.

    .venv/bin/python bench/fp8.py
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch import WORK, bundle, checkpoint  # noqa: E402
from common import REPO, decode_step_times, ensure_bundle, median, write_result  # noqa: E402

FP8_MANIFEST = """neffkit: 1
name: batch-fp8
model: {model}
dtype: bfloat16
buckets: {{prefill: [32], decode: [1, 4, 8], context: [128]}}
"""
PROMPTS = [[5 + i, 6, 7, 8] for i in range(8)]


def fp8_bundle() -> Path:
    model = WORK / "llama-125m-fp8"
    if not (model / "config.json").exists():
        tool = REPO / "tools" / "make_fp8_model.py"
        cmd = [sys.executable, str(tool), str(checkpoint()), str(model), "--block", "128", "128"]
        subprocess.run(cmd, check=True)
    manifest = WORK / "batch-fp8.yaml"
    manifest.write_text(FP8_MANIFEST.format(model=model))
    return ensure_bundle(manifest, WORK / "bundle-fp8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    from neffkit.runtime.llm import LLM
    from neffkit.runtime.loader import load
    from neffkit.runtime.sampling_params import SamplingParams

    paths = {
        "float32": bundle("float32", "kernel"),
        "bfloat16": bundle("bfloat16", "kernel"),
        "fp8": fp8_bundle(),
    }
    llms = {k: LLM(load(p)) for k, p in paths.items()}
    times: dict[str, list[float]] = {k: [] for k in llms}
    for _ in range(args.rounds):  # alternate: the machine's noise hits every case alike
        for k, llm in llms.items():
            times[k].append(1000 * median(decode_step_times(llm.core, PROMPTS[:1], args.steps)))
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    tokens = {k: [s.output_ids for s in llm.generate(PROMPTS, params)] for k, llm in llms.items()}
    total = sum(len(t) for t in tokens["float32"])

    def agreement(kind: str) -> float:
        pairs = zip(tokens[kind], tokens["float32"], strict=True)
        return sum(a == b for x, y in pairs for a, b in zip(x, y, strict=True)) / total

    rows = {
        k: {
            "weight_bytes": (paths[k] / "weights" / "rank0.safetensors").stat().st_size,
            "b1_step_ms": round(median(times[k]), 2),
            "greedy_agreement_with_fp32": round(agreement(k), 3),
        }
        for k in llms
    }
    for k in rows:
        rows[k]["bytes_vs_fp32"] = round(
            rows[k]["weight_bytes"] / rows["float32"]["weight_bytes"], 3
        )
        rows[k]["step_vs_fp32"] = round(rows[k]["b1_step_ms"] / rows["float32"]["b1_step_ms"], 2)
    result = {
        "model": "random Llama, 125M parameters (bench/batch.py's checkpoint)",
        "fp8_block": [128, 128],
        "rows": rows,
    }
    print(result)
    print(f"wrote {write_result('fp8', result)}")


if __name__ == "__main__":
    main()
