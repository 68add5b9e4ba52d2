"""Adapters' cost on SmolLM2-135M: the decode step of a batch of 8 on the base bundle, and on a
bundle with 4 adapter slots of rank 16 (every projection) serving the base only and 4 distinct
adapters (two rows each); and what registering and writing a rank-16 adapter takes.

    python bench/lora.py                      # 3 alternating rounds, medians
    python bench/lora.py --rounds 5 --steps 48

Needs models/smollm2-135m-instruct (`make demo` converts it). The adapters are random PEFT
rank-16 adapters made by peft (nonzero A and B). Writes bench/results/lora.json.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, decode_step_times, ensure_bundle, median, parse_args, write_result  # noqa: E402

MODEL = REPO / "models" / "smollm2-135m-instruct"
WORK = REPO / "bench" / "work" / "lora"
ADAPTERS = 4
RANK = 16
BATCH = 8
MAKE_ADAPTERS = """
import sys, torch, transformers
from peft import LoraConfig, get_peft_model
base, out, count, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
for i in range(count):
    torch.manual_seed(i)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
    config.init_lora_weights = False  # nonzero B: the adapters change the outputs
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(f"{out}/adapter{i}")
"""


def bundles() -> tuple[Path, Path]:
    """The base bundle and the one with adapter slots (same buckets, same everything else)."""
    WORK.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {
        "neffkit": 1,
        "model": str(MODEL),
        "dtype": "float32",
        "kv_cache": {"block_size": 16},
        "buckets": {"prefill": [64], "decode": [BATCH], "context": [256]},
        "sampling": {"max_top_k": 16, "structured": False, "max_penalty_tokens": 0},
    }
    out = []
    slots = {"lora": {"max_loras": ADAPTERS, "max_rank": RANK}}
    for name, extra in (("base", {}), ("lora", slots)):
        path = WORK / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**manifest, "name": f"smollm2-{name}", **extra}))
        out.append(ensure_bundle(path, WORK / f"bundle-{name}"))
    return out[0], out[1]


def adapters() -> list[Path]:
    root = WORK / "adapters"
    paths = [root / f"adapter{i}" for i in range(ADAPTERS)]
    if not all((p / "adapter_model.safetensors").exists() for p in paths):
        cmd = [sys.executable, "-c", MAKE_ADAPTERS, str(MODEL), str(root), str(ADAPTERS), str(RANK)]
        subprocess.run(cmd, check=True, cwd=REPO)
    return paths


def step_ms(engine: Any, names: list[str | None], steps: int) -> float:
    """Median wall time of a decode step once all BATCH rows decode (host work included)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40000) for _ in range(32)] for _ in names]
    return 1000 * median(decode_step_times(engine, prompts, steps, names))


def load_ms(llm: Any, paths: list[Path]) -> dict[str, float]:
    """Registering (read + check + fold) a rank-16 adapter, and writing it into a slot."""
    from neffkit.runtime.lora.peft_adapter import read_adapter

    slots = llm.loaded.adapters
    read, write = [], []
    for i, path in enumerate(paths * 2):
        t0 = time.perf_counter()
        adapter = read_adapter(f"timed{i}", path, slots.lora)
        t1 = time.perf_counter()
        slots.write(1 + i % ADAPTERS, adapter)
        read.append(1000 * (t1 - t0))
        write.append(1000 * (time.perf_counter() - t1))
    total = median(read) + median(write)
    return {"read_ms": median(read), "write_ms": median(write), "total_ms": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    args = parse_args(ap)
    import torch

    from neffkit.runtime.engine.core import engine_threads
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load

    torch.set_num_threads(engine_threads())
    base_bundle, lora_bundle = bundles()
    paths = adapters()
    base = LLM(load(base_bundle))
    lora = LLM(load(lora_bundle), lora_modules={f"a{i}": p for i, p in enumerate(paths)})
    mixed = [f"a{i % ADAPTERS}" for i in range(BATCH)]
    cells: dict[str, list[float]] = {"base": [], "slots_base_rows": [], "slots_4_adapters": []}
    for r in range(args.rounds):  # alternating: the host is shared
        cells["base"].append(step_ms(base.core, [None] * BATCH, args.steps))
        cells["slots_base_rows"].append(step_ms(lora.core, [None] * BATCH, args.steps))
        cells["slots_4_adapters"].append(step_ms(lora.core, list(mixed), args.steps))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in cells.items()))
    medians = {k: median(v) for k, v in cells.items()}
    result = {
        "model": "SmolLM2-135M-Instruct float32",
        "batch": BATCH,
        "max_loras": ADAPTERS,
        "rank": RANK,
        "rounds": args.rounds,
        "step_ms": medians,
        "step_ms_rounds": cells,
        "ratio_4_adapters_vs_base": medians["slots_4_adapters"] / medians["base"],
        "ratio_base_rows_vs_base": medians["slots_base_rows"] / medians["base"],
        # each round's ratio, its median: the host's drift between rounds cancels
        "ratio_4_adapters_vs_base_paired": median(
            [a / b for a, b in zip(cells["slots_4_adapters"], cells["base"], strict=True)]
        ),
        "adapter_load": load_ms(lora, paths),
    }
    print(
        f"4 adapters / base: {result['ratio_4_adapters_vs_base']:.3f}x "
        f"(paired {result['ratio_4_adapters_vs_base_paired']:.3f}x); "
        f"load {result['adapter_load']['total_ms']:.1f} ms"
    )
    print(f"written {write_result('lora', result)}")


if __name__ == "__main__":
    main()
