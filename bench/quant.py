"""Speed and memory of the manifest's weight quantization: SmolLM2-135M-Instruct (`make demo`'s
float32 checkpoint) built three ways from one manifest (manifests/smollm2.yaml's buckets:
prefill 64, decode 1, context 512): float32, `quantization: {weights: int8}` (per output
channel) and `{weights: int4, group_size: 32}`.

Speed: the batch-1 decode step of each bundle, in-process (the LLM engine, host work included,
as bench/fp8.py), in alternating rounds so the shared machine's noise hits every bundle alike;
each round's figure is the median step, the reported one the median of the rounds. Beside the
wall time, the process's CPU time per step (all threads): a second view that other processes on
a loaded host disturb less.

Exactness: each quantized bundle's greedy tokens against HF transformers on its float twin
(the checkpoint with every quantized weight replaced by its dequantized values), three prompts.

Memory: each bundle served (`neffkit run BUNDLE --port`, bench/serve.py's `start_server`), two
requests answered (one prompt longer than the prefill bucket), then the resident memory of the
server's processes and of its engine core (the process that holds the bundle) against the
bundle's weight bytes plus its KV cache bytes. The part of the engine's RSS that no bundle's
weights add is measured in a fresh process (`floor`): the interpreter with torch and the runtime
imported, the bundle's tokenizer and its structured-output grammars loaded (the text side, 50 MiB
for SmolLM2's 49k-token vocabulary); the engine's RSS above that is what serving the weights and
the KV cache costs.

Writes bench/results/quant.json.

    .venv/bin/python bench/quant.py [--rounds 7] [--steps 32] [--reuse]
        [--skip-speed] [--skip-twin] [--skip-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, ensure_bundle, median, parse_args, start_server, write_result  # noqa: E402

WORK = REPO / "bench" / "work" / "quant"
MODEL = REPO / "models" / "smollm2-135m-instruct"
MANIFEST = """neffkit: 1
name: smollm2-{name}
model: {model}
dtype: float32
target: cpu
kv_cache: {{block_size: 16}}
buckets: {{prefill: [64], decode: [1], context: [512]}}
sampling: {{max_top_k: 64}}
"""
GROUP = 32  # int4: inputs per scale
VARIANTS = {
    "float32": "",
    "int8": "quantization: {weights: int8}\n",
    "int4": f"quantization: {{weights: int4, group_size: {GROUP}}}\n",
}
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Water boils at")
TARGETS = {"int8": 0.60, "int4": 0.45}  # step / float32 step
RSS_TARGET = 1.2  # the engine's RSS above the floor / (weight bytes + KV bytes)


def bundle(name: str, reuse: bool) -> Path:
    """Build (or bring up to date) one variant's bundle; `reuse`: take a built one as it is."""
    if not (MODEL / "config.json").exists():
        raise SystemExit(f"{MODEL} is missing: `make demo` converts SmolLM2 there")
    WORK.mkdir(parents=True, exist_ok=True)
    manifest, out = WORK / f"smollm2-{name}.yaml", WORK / f"bundle-{name}"
    manifest.write_text(MANIFEST.format(name=name, model=MODEL) + VARIANTS[name])
    if reuse and (out / "bundle.json").exists():
        return out
    return ensure_bundle(manifest, out)


def weight_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in (path / "weights").glob("*.safetensors"))


def kv_bytes(path: Path) -> int:
    """The KV cache the runtime allocates: every graph's `k_cache.*` / `v_cache.*` input names
    one tensor of the pool (the graphs share it)."""
    graph = json.loads((path / "bundle.json").read_text())["graphs"][0]
    size = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
    total = 0
    for spec in graph["inputs"]:
        if spec["name"].startswith(("k_cache.", "v_cache.", "kv_cache.")):
            count = 1
            for dim in spec["shape"]:
                count *= dim
            total += count * size[spec["dtype"]]
    return total


def prompt_ids() -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in PROMPTS]


def step_times(core: Any, prompt: list[int], steps: int) -> tuple[list[float], list[float]]:
    """(wall, process CPU) seconds of each engine step once the sequence is decoding."""
    from neffkit.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    seq = core.add_request(prompt, params)
    while not seq.output_ids:
        core.step()
    wall, cpu = [], []
    while core.has_work():
        t0, c0 = time.perf_counter(), time.process_time()
        core.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def greedy(llm: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from neffkit.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [out.output_ids for out in llm.generate(prompts, params)]


def forms(path: Path) -> dict[str, str]:
    """Each graph's projection form as bundle.json records it."""
    graphs = json.loads((path / "bundle.json").read_text())["graphs"]
    return {g["artifact"].split("/")[-1].removesuffix(".pt2"): g["projection"] for g in graphs}


def speed(paths: dict[str, Path], rounds: int, steps: int) -> dict[str, Any]:
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load

    prompts = prompt_ids()
    llms = {k: LLM(load(p)) for k, p in paths.items()}
    wall: dict[str, list[float]] = {k: [] for k in llms}
    cpu: dict[str, list[float]] = {k: [] for k in llms}
    for llm in llms.values():  # warm: the first calls page the weights in
        step_times(llm.core, prompts[0], 4)
    for _ in range(rounds):  # alternate: the machine's noise hits every bundle alike
        for k, llm in llms.items():
            w, c = step_times(llm.core, prompts[0], steps)
            wall[k].append(1000 * median(w))
            cpu[k].append(1000 * median(c))
        print({k: round(v[-1], 2) for k, v in wall.items()}, flush=True)
    tokens = {k: greedy(llm, prompts, 24) for k, llm in llms.items()}
    base_wall, base_cpu = median(wall["float32"]), median(cpu["float32"])
    rows = {}
    for k in llms:
        runs = zip(tokens[k], tokens["float32"], strict=True)
        pairs = [(a, b) for x, y in runs for a, b in zip(x, y, strict=True)]
        rows[k] = {
            "weight_bytes": weight_bytes(paths[k]),
            "projection_forms": forms(paths[k]),
            "b1_step_ms": round(median(wall[k]), 2),
            "b1_step_ms_rounds": [round(t, 2) for t in wall[k]],
            "step_vs_fp32": round(median(wall[k]) / base_wall, 3),
            "b1_step_cpu_ms": round(median(cpu[k]), 2),
            "cpu_vs_fp32": round(median(cpu[k]) / base_cpu, 3),
            "greedy_agreement_with_fp32": round(sum(a == b for a, b in pairs) / len(pairs), 3),
        }
        if k in TARGETS:
            rows[k]["target_step_vs_fp32"] = TARGETS[k]
            rows[k]["meets_target"] = rows[k]["step_vs_fp32"] <= TARGETS[k]
    return {"rounds": rounds, "steps_per_round": steps, "rows": rows}


def twin_exactness(paths: dict[str, Path]) -> dict[str, Any]:
    """Greedy tokens of each quantized bundle against HF on its float twin (weights replaced by
    their dequantized values: `QuantTensor.dequantized`, the values the graph widens to)."""
    import torch
    import transformers

    from neffkit.checkpoints.quantized import SafetensorsSource
    from neffkit.checkpoints.requantize import QuantizingSource
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load

    prompts, out = prompt_ids(), {}
    for k, spec in (("int8", "int8"), ("int4", f"int4:{GROUP}")):
        source = QuantizingSource(SafetensorsSource(MODEL), spec, (), True)
        hf = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
        state = hf.state_dict()  # the tied table is the LM head too
        with torch.no_grad():
            for name in source.names:
                if source.scheme(name) is not None:
                    state[name].copy_(source.read(name).dequantized())
            want = []
            for ids in prompts:
                x = torch.tensor([ids])
                g = hf.generate(x, max_new_tokens=24, do_sample=False, min_new_tokens=24)
                want.append(g[0, len(ids) :].tolist())
        got = greedy(LLM(load(paths[k])), prompts, 24)
        out[k] = {"prompts": len(prompts), "tokens_each": 24, "equal": got == want}
        print(k, "greedy equals HF on the twin:", got == want, flush=True)
    return out


def engine_rss(pid: int) -> tuple[int, int]:
    """(RSS of the server and all its children, RSS of its engine core: the largest child)."""
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    rss = [p.memory_info().rss for p in procs]
    return sum(rss), max(rss[1:])


def served_rss(path: Path) -> dict[str, Any]:
    """RSS of the server on `path` after two answered requests (a short prompt, and one of 300
    tokens: five prefill chunks)."""
    import httpx

    proc, url = start_server(path, "--no-access-log")
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        for prompt in (PROMPTS[0], " ".join(["word"] * 300)):
            body = {"model": model, "prompt": prompt, "max_tokens": 16}
            httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
        time.sleep(1)
        tree, engine = engine_rss(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"server_tree_rss_mib": mib(tree), "engine_rss_mib": mib(engine)}


FLOOR = """
import os, sys, psutil, torch
import neffkit.runtime.engine.llm, neffkit.runtime.serve
from neffkit.contract.read import read_bundle
from neffkit.runtime.config import SchedulerConfig
from neffkit.runtime.engine.structured import Grammars
from neffkit.runtime.tokenizer import Tokenizer
bundle = read_bundle(sys.argv[1], verify=False)
config = SchedulerConfig.of(bundle.record)
tokenizer = Tokenizer.from_dir(bundle.path(bundle.record.tokenizer))
grammars = Grammars.of(tokenizer, config.vocab_size, config.eos_token_ids)
print(psutil.Process(os.getpid()).memory_info().rss)
"""


def floor_rss(path: Path) -> int:
    """RSS of a fresh interpreter with torch and the runtime imported and the bundle's text side
    (tokenizer, structured-output grammars) loaded: what an engine holds before any weight or
    KV cache."""
    cmd = [sys.executable, "-c", FLOOR, str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    return int(out.stdout.split()[-1])


def mib(n: float) -> float:
    return round(n / 2**20, 1)


def memory(paths: dict[str, Path]) -> dict[str, Any]:
    rows = {}
    for k, path in paths.items():
        floor, served = floor_rss(path), served_rss(path)
        weights, kv = weight_bytes(path), kv_bytes(path)
        above = served["engine_rss_mib"] - mib(floor)
        rows[k] = {
            **served,
            "floor_rss_mib": mib(floor),
            "engine_above_floor_mib": round(above, 1),
            "weight_mib": mib(weights),
            "kv_mib": mib(kv),
            "above_floor_vs_weights_and_kv": round(above / (mib(weights) + mib(kv)), 3),
            "engine_vs_weights_and_kv": round(served["engine_rss_mib"] / mib(weights + kv), 3),
            "target": RSS_TARGET,
        }
        print(k, rows[k], flush=True)
    return {"rows": rows}


def host() -> dict[str, Any]:
    """The CPU and every /proc/cpuinfo flag of this host, and its load when the run began."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo if ln.startswith("flags")), [])
    return {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "flags": flags}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reuse", action="store_true", help="take built bundles as they are")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-twin", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    args = parse_args(ap)
    paths = {name: bundle(name, args.reuse) for name in VARIANTS}
    previous = REPO / "bench" / "results" / "quant.json"
    result: dict[str, Any] = json.loads(previous.read_text()) if previous.exists() else {}
    result.pop("machine", None)
    result.update(
        model="SmolLM2-135M-Instruct (float32 checkpoint)",
        buckets={"prefill": [64], "decode": [1], "context": [512]},
        int4_group_size=GROUP,
        host=host(),
    )
    if not args.skip_speed:
        result["speed"] = speed(paths, args.rounds, args.steps)
    if not args.skip_twin:
        result["greedy_vs_hf_twin"] = twin_exactness(paths)
    if not args.skip_memory:
        result["memory"] = memory(paths)
    print(json.dumps({k: v for k, v in result.items() if k != "host"}, indent=2))
    print(f"wrote {write_result('quant', result)}")


if __name__ == "__main__":
    main()
