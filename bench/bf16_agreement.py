"""bf16 agreement on real checkpoints: greedy tokens of a bf16 bundle against HF transformers in
bf16 and in float32 (and HF bf16 against HF float32, the drift bf16 itself brings).

    .venv/bin/python bench/bf16_agreement.py --model models/smollm2-135m-instruct \
        --model DIR_OF_GEMMA3_270M      # `neffkit convert` of the Gemma 3 270M GGUF file

Per model: 5 prompts x 64 greedy tokens (SmolLM2-Instruct's through its chat template), a bf16
bundle at tp=1 built once into bundles/<name>-bf16. Agreement of two runs on a prompt is the
length of their common prefix over 64 (greedy runs part for good at the first differing token);
reported per pair as the mean over prompts and the prompts that agree to the end. Writes
bench/results/bf16_agreement.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, ensure_bundle, write_result  # noqa: E402

TOKENS = 64
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Explain what a compiler does in one sentence.",
]
TEXT = [
    "def fibonacci(n):",
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n\n# Compute the mean of an array\n",
]


def prompts_for(model_dir: Path) -> list[list[int]]:
    """Chat prompts for an instruction-tuned checkpoint (its directory says "instruct"), plain
    text for a base model."""
    from neffkit.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    if "instruct" in model_dir.name.lower():
        return [tok.encode_chat([{"role": "user", "content": q}]) for q in CHAT]
    return [tok.encode(p) for p in TEXT]


def bf16_bundle(model_dir: Path, name: str) -> Path:
    manifest = REPO / "bench" / "results" / f".{name}-bf16.yaml"
    manifest.write_text(
        "neffkit: 1\n"
        f"name: {name}-bf16\n"
        f"model: {model_dir.resolve()}\n"
        "dtype: bfloat16\n"
        "target: cpu\n"
        "kv_cache: {block_size: 16}\n"
        "buckets: {prefill: [64], decode: [1], context: [256]}\n"
        "sampling: {max_top_k: 16}\n"
    )
    try:
        return ensure_bundle(manifest, REPO / "bundles" / f"{name}-bf16")
    finally:
        manifest.unlink()


def neffkit_greedy(bundle: Path, prompts: list[list[int]]) -> list[list[int]]:
    cmd = [
        sys.executable,
        "-m",
        "neffkit",
        "run",
        str(bundle),
        "--max-tokens",
        str(TOKENS),
        "--ignore-eos",
        "--json",
    ]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout
    return [o["token_ids"] for o in json.loads(out)["outputs"]]


def hf_greedy(model_dir: Path, prompts: list[list[int]], dtype: torch.dtype) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=TOKENS,
                min_new_tokens=TOKENS,
            )
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, object]:
    prefixes = []
    for x, y in zip(a, b, strict=True):
        same = (i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q)
        n = next(same, min(len(x), len(y)))
        prefixes.append(n)
    return {
        "common_prefix": prefixes,
        "mean_agreement": round(sum(prefixes) / (TOKENS * len(prefixes)), 3),
        "prompts_equal_to_the_end": sum(n == TOKENS for n in prefixes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, action="append", required=True)
    args = parser.parse_args()
    rows = []
    for model_dir in args.model:
        name = model_dir.resolve().name
        prompts = prompts_for(model_dir)
        ours = neffkit_greedy(bf16_bundle(model_dir, name), prompts)
        hf_bf16 = hf_greedy(model_dir, prompts, torch.bfloat16)
        hf_fp32 = hf_greedy(model_dir, prompts, torch.float32)
        row = {
            "model": name,
            "prompts": len(prompts),
            "tokens": TOKENS,
            "neffkit_bf16_vs_hf_bf16": agreement(ours, hf_bf16),
            "neffkit_bf16_vs_hf_fp32": agreement(ours, hf_fp32),
            "hf_bf16_vs_hf_fp32": agreement(hf_bf16, hf_fp32),
        }
        print(json.dumps(row))
        rows.append(row)
    write_result("bf16_agreement", {"models": rows})


if __name__ == "__main__":
    main()
