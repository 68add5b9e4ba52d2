"""Decode batch scaling on a bandwidth-bound model: the batch-8 step against the batch-1 step.

A random 125M-parameter Llama (hidden 1024, 6 layers, vocab 32000) built in float32 and bfloat16
with decode buckets [1, 4, 8], once per projection form: "inductor" (`compiler.cpu_kernel: off`:
Inductor's register-blocked reductions over the blocked weights) and "kernel" (the default,
`auto`: neffkit's C++ kernel, neffkit/platform/csrc/blocked_rows.cpp). A bandwidth-bound step
streams the weights once whatever the batch, so a batch-8 step should cost about what a batch-1
step costs.
Both forms alternate in the same rounds; medians. Writes bench/results/batch.json.

    .venv/bin/python bench/batch.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, decode_step_times, ensure_bundle, median, parse_args, write_result  # noqa: E402

WORK = REPO / "bench" / "work" / "batch"
SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
BATCHES = (1, 4, 8)
DTYPES = ("float32", "bfloat16")
VARIANTS = {"inductor": "off", "kernel": "auto"}  # label → compiler.cpu_kernel
MANIFEST = """neffkit: 1
name: batch-{dtype}
model: {model}
dtype: {dtype}
buckets: {{prefill: [32], decode: [1, 4, 8], context: [128]}}
compiler: {{cpu_kernel: {kernel}}}
"""


def checkpoint() -> Path:
    out = WORK / "llama-125m"
    if not (out / "config.json").exists():
        import transformers

        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(out)
    return out


def bundle(dtype: str, label: str) -> Path:
    manifest = WORK / f"batch-{dtype}-{label}.yaml"
    kernel = VARIANTS[label]
    manifest.write_text(MANIFEST.format(dtype=dtype, model=checkpoint(), kernel=kernel))
    return ensure_bundle(manifest, WORK / f"bundle-{dtype}-{label}")


def kernel_ceiling() -> dict[str, float]:
    """What the kernel computes when memory is not the limit: 8 rows on a weight that stays in
    L2 (1024 x 256), multiply-adds per second on all threads. A batch-8 step of the 125M model
    does 8 x its projection parameters of them: the step's compute floor."""
    import time

    from neffkit.models.projection import to_blocked
    from neffkit.platform import cpu_kernels

    cpu_kernels.load_library(cpu_kernels.build_library())
    out = {}
    for dtype in DTYPES:
        w = to_blocked(torch.randn(1024, 256).to(getattr(torch, dtype)), 16)
        x = torch.randn(8, 256).to(w.dtype)
        rates = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(2000):
                torch.ops.neffkit.blocked_rows(x, [w])
            rates.append(2000 * 8 * 1024 * 256 / (time.perf_counter() - t0))
        out[f"{dtype}_b8_gmac_per_s"] = round(median(rates) / 1e9, 1)
    model = projection_parameters()
    for dtype in DTYPES:
        out[f"{dtype}_b8_floor_ms"] = round(8 * model / (out[f"{dtype}_b8_gmac_per_s"] * 1e6), 2)
    out["projection_parameters"] = model
    out["bfloat16_rows"] = "AMX tiles" if torch.ops.neffkit.set_amx(True) else "FMA"
    return out


def projection_parameters() -> int:
    """Projection parameters of SHAPE (q, k, v, o, gate, up, down per layer, and the LM head)."""
    h, i, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    kv = h * SHAPE["num_key_value_heads"] // SHAPE["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i
    return SHAPE["num_hidden_layers"] * per_layer + v * h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    args = parse_args(ap)
    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.engine.loading import load

    dirs = {(label, d): bundle(d, label) for label in VARIANTS for d in DTYPES}
    engines = {key: EngineCore(load(path).runner) for key, path in dirs.items()}
    times: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(args.rounds):  # alternate: the machine's noise hits every case alike
        for (label, dtype), engine in engines.items():
            for batch in BATCHES:
                prompts = [[5 + i, 6, 7, 8] for i in range(batch)]
                step = median(decode_step_times(engine, prompts, args.steps))
                times.setdefault((label, dtype, batch), []).append(1000 * step)
    data: dict[str, dict] = {}
    for (label, dtype, batch), values in times.items():
        data.setdefault(label, {})[f"{dtype}_b{batch}_ms"] = round(median(values), 3)
    for (label, dtype), path in dirs.items():
        figures = data[label]
        b1, b8 = figures[f"{dtype}_b1_ms"], figures[f"{dtype}_b8_ms"]
        figures[f"{dtype}_b8_over_b1"] = round(b8 / b1, 2)
        figures[f"{dtype}_b8_tokens_per_s_over_b1"] = round(8 * b1 / b8, 2)
        graphs = json.loads((path / "bundle.json").read_text())["graphs"]
        figures[f"{dtype}_projection"] = {g["name"]: g.get("projection") for g in graphs}
    for figures in data.values():
        figures["bf16_b1_over_fp32_b1"] = round(
            figures["bfloat16_b1_ms"] / figures["float32_b1_ms"], 2
        )
    data["compute"] = kernel_ceiling()
    data["model"] = {**SHAPE, "parameters": "125M"}
    data["rounds"] = args.rounds
    print(json.dumps(data, indent=2))
    write_result("batch", data)


if __name__ == "__main__":
    main()
