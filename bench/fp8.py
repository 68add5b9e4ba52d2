"""fp32, bf16 and block-fp8 weights of one 125M-parameter Llama side by side, and how far bf16
weights, fp8 weights and an fp8 KV cache move a real model's next-token distribution.

Speed: bench/batch.py's random checkpoint (hidden 1024, 6 layers, vocab 32000), quantized to
DeepSeek's block fp8 (128x128, tools/make_fp8_model.py; unquantized tensors in bfloat16). Reports
weight bytes per rank shard (what a decode step streams), batch-1 decode step time (median of
alternating rounds), and greedy agreement of the fp8 bundle with the unquantized fp32 one.

Accuracy: SmolLM2-135M-Instruct (`make demo`'s checkpoint) over a fixed text of 768 tokens
(bench/data/kl_text.txt): the mean over positions of KL(HF float32 || neffkit variant) of the
next-token distribution. Each variant's logits come from neffkit's model code run eagerly (the
code its graphs are traced from: one prefill at every position, the cache written and read back
as a graph does): float32 (the baseline's own error), bf16 weights, fp8 weights (block 128x128,
the rest float32), fp8 weights with the LM head quantized too (`lm_head.dtype`), and an fp8 KV
cache: the default (calibrated scales, keys centered, weighted and rotated:
kv_cache.rotate_keys), keys as they are (calibrated scales), and scale 1.0.

Writes bench/results/fp8.json.

    .venv/bin/python bench/fp8.py [--skip-speed] [--skip-kl]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch import WORK, bundle, checkpoint  # noqa: E402
from common import REPO, decode_step_times, ensure_bundle, median, parse_args, write_result  # noqa: E402

FP8_MANIFEST = """neffkit: 1
name: batch-fp8
model: {model}
dtype: bfloat16
buckets: {{prefill: [32], decode: [1, 4, 8], context: [128]}}
"""
PROMPTS = [[5 + i, 6, 7, 8] for i in range(8)]
RESULT = REPO / "bench" / "results" / "fp8.json"
KL_TEXT = REPO / "bench" / "data" / "kl_text.txt"
KL_MANIFEST = """neffkit: 1
name: kl
model: {model}
dtype: {dtype}
kv_cache: {kv}
buckets: {{prefill: [{tokens}], decode: [1], context: [{tokens}]}}
lm_head: {head}
"""


def fp8_bundle() -> Path:
    model = WORK / "llama-125m-fp8"
    if not (model / "config.json").exists():
        tool = REPO / "tools" / "make_fp8_model.py"
        cmd = [sys.executable, str(tool), str(checkpoint()), str(model), "--block", "128", "128"]
        subprocess.run(cmd, check=True)
    manifest = WORK / "batch-fp8.yaml"
    manifest.write_text(FP8_MANIFEST.format(model=model))
    return ensure_bundle(manifest, WORK / "bundle-fp8")


def kl_divergences() -> dict:
    """Mean next-token KL from HF float32 on SmolLM2 over the fixed text, per variant."""
    import torch
    import transformers
    from llamacpp_build import MODEL, fp8_checkpoint
    from tokenizers import Tokenizer

    from neffkit.compile.calibrate import calibrated, eager_prefill
    from neffkit.compile.layout import model_layout
    from neffkit.manifest import load_manifest

    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    ids = tokenizer.encode(KL_TEXT.read_text()).ids
    ids = ids[: len(ids) // 16 * 16]
    hf = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    del hf
    fp8_head = {"dtype": "float8_e4m3fn"}
    variants = {
        "float32": (MODEL, "float32", {}, {}),
        "bf16 weights": (MODEL, "bfloat16", {}, {}),
        "fp8 weights": (fp8_checkpoint(), "float32", {}, {}),
        "fp8 weights and LM head": (fp8_checkpoint(), "float32", {}, fp8_head),
        "fp8 KV, calibrated scales": (MODEL, "float32", {"dtype": "float8_e4m3fn"}, {}),
        "fp8 KV, calibrated scales, keys as they are": (
            MODEL,
            "float32",
            {"dtype": "float8_e4m3fn", "rotate_keys": False},
            {},
        ),
        "fp8 KV, scale 1.0": (MODEL, "float32", {"dtype": "float8_e4m3fn", "calibrate": False}, {}),
    }
    out = {}
    for name, (model, dtype, kv, head) in variants.items():
        path = WORK / f"kl-{len(out)}.yaml"
        WORK.mkdir(parents=True, exist_ok=True)
        cache = {"block_size": 16, **kv}
        text = KL_MANIFEST.format(
            model=model, dtype=dtype, tokens=len(ids), kv=json.dumps(cache), head=json.dumps(head)
        )
        path.write_text(text)
        manifest = load_manifest(path)
        layout = calibrated(manifest, model_layout(manifest, "cpu"))
        _, logits = eager_prefill(layout, manifest.model, ids, logits=True)
        logq = torch.log_softmax(logits, -1)
        kl = (reference.exp() * (reference - logq)).sum(-1)
        same = (logq.argmax(-1) == reference.argmax(-1)).float().mean().item()
        out[name] = {"mean_kl": round(kl.mean().item(), 6), "top1_agreement": round(same, 4)}
        print(name, out[name], flush=True)
    bf16 = out["bf16 weights"]["mean_kl"]
    for row in out.values():
        row["kl_vs_bf16_weights"] = round(row["mean_kl"] / bf16, 3)
    return {"tokens": len(ids), "rows": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-kl", action="store_true")
    args = parse_args(ap)
    previous = json.loads(RESULT.read_text()) if RESULT.exists() else {}
    result: dict = {k: v for k, v in previous.items() if k != "machine"}
    if not args.skip_speed:
        result.update(speed(args))
    if not args.skip_kl:
        result["kl"] = {
            "model": "SmolLM2-135M-Instruct",
            "text": "bench/data/kl_text.txt",
            "reference": "HF transformers, float32",
            **kl_divergences(),
        }
    print(json.dumps(result, indent=2))
    print(f"wrote {write_result('fp8', result)}")


def speed(args: argparse.Namespace) -> dict:
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load
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
    return {
        "model": "random Llama, 125M parameters (bench/batch.py's checkpoint)",
        "fp8_block": [128, 128],
        "rows": rows,
    }


if __name__ == "__main__":
    main()
