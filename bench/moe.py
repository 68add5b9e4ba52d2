"""MoE decode: does a step read only the routed experts? 64 experts against 8, top-2, batch 1.

Two random Mixtral checkpoints that differ only in their number of experts (hidden 1024, expert
intermediate 512, 4 layers; 64 experts are 0.4 B parameters, 1.6 GB in float32, so the step is
bound by memory bandwidth, not by the cache). A decode step that gathers its 2 routed experts
costs about the same in both; one that runs every expert costs ~8x more with 64. Runs alternate
between the two bundles and report medians. Writes bench/results/moe.json; `--label before`
records the same figures from a checkout of an earlier commit (run this file from there).

    .venv/bin/python bench/moe.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, RESULTS, decode_step_times, ensure_bundle, median, parse_args, write_result  # noqa: E402

WORK = REPO / "bench" / "work" / "moe"
SHAPE = dict(
    hidden_size=1024,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=1024,
    max_position_embeddings=512,
    num_experts_per_tok=2,
)
MANIFEST = """neffkit: 1
name: moe-{experts}
model: {model}
dtype: float32
buckets: {{prefill: [16], decode: [1], context: [128]}}
"""


def checkpoint(experts: int) -> Path:
    out = WORK / f"mixtral-e{experts}"
    if not (out / "config.json").exists():
        import transformers

        torch.manual_seed(0)
        config = transformers.MixtralConfig(**SHAPE, num_local_experts=experts)
        transformers.MixtralForCausalLM(config).save_pretrained(out)
    return out


def bundle(experts: int) -> Path:
    manifest = WORK / f"moe-e{experts}.yaml"
    manifest.write_text(MANIFEST.format(experts=experts, model=checkpoint(experts)))
    return ensure_bundle(manifest, WORK / f"bundle-e{experts}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--label", default="after", help="after | before (an earlier checkout)")
    args = parse_args(ap)
    from neffkit.runtime.engine.core import EngineCore
    from neffkit.runtime.engine.loading import load

    engines = {e: EngineCore(load(bundle(e)).runner) for e in (8, 64)}
    times: dict[int, list[float]] = {8: [], 64: []}
    for _ in range(args.rounds):  # alternate: the machine's noise hits both alike
        for experts, engine in engines.items():
            steps = decode_step_times(engine, [[5, 6, 7, 8]], args.steps)
            times[experts].append(median(steps) * 1000)
    figures = {f"e{e}_ms_per_step": round(median(t), 3) for e, t in times.items()}
    figures["ratio_e64_to_e8"] = round(figures["e64_ms_per_step"] / figures["e8_ms_per_step"], 2)
    path = RESULTS / "moe.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[args.label] = figures
    data.setdefault("model", {**SHAPE, "experts": [8, 64], "batch": 1})
    print(json.dumps({args.label: figures}, indent=2))
    write_result("moe", {k: v for k, v in data.items() if k != "machine"})


if __name__ == "__main__":
    main()
