"""neffkit against the CPU peers that also build ahead of time, same checkpoint, same run.

ONNX Runtime GenAI (`onnxruntime_genai.models.builder`, fp32, cpu) and OpenVINO GenAI (`optimum-cli
export openvino`, fp32 weights; inference precision hint f32 or bf16) on bench/batch.py's random
125M-parameter Llama (hidden 1024, 6 layers, vocab 32000), with the demo tokenizer so the
exporters convert one. The peers run in `.venv-peers` (optimum-intel pins its own transformers:
`make peers-venv`) through bench/peers_worker.py; neffkit runs here on bench/batch.py's manifest
with packed prefill (`prefill_batch: [1, 8]`).

Reported: build time (cold: every cache empty, Inductor's and the kernel autotuning's included);
batch 1: per-token decode (median step, prefill excluded); batch 8: eight
4-token prompts, 48 new tokens each, end to end (prefill included), aggregate tokens/s (OpenVINO:
its ContinuousBatchingPipeline; ONNX Runtime GenAI: one batched generator; neffkit:
`LLM.generate`). Each peer's greedy tokens are checked against HF transformers on the same ids.
Rounds alternate systems; medians. Writes bench/results/peers.json; `--result peers_intel` keeps a
second host's run beside it (docs/performance.md shows both).

    .venv/bin/python bench/peers.py [--rounds 3] [--result peers]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch import MANIFEST, checkpoint  # noqa: E402
from common import (  # noqa: E402
    REPO,
    cold_env,
    decode_step_times,
    ensure_bundle,
    median,
    parse_args,
    write_result,
)

WORK = REPO / "bench" / "work" / "peers"
PEERS_PY = REPO / ".venv-peers" / "bin" / "python"
WORKER = REPO / "bench" / "peers_worker.py"
NEW_TOKENS = 48
PROMPTS = [[5 + i, 6, 7, 8] for i in range(8)]
TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


def peer_model() -> Path:
    """The 125M checkpoint with the demo tokenizer beside it (the exporters convert one)."""
    out = WORK / "llama-125m-tok"
    if not (out / "config.json").exists():
        shutil.copytree(checkpoint(), out, dirs_exist_ok=True)
        for name in TOKENIZER:
            shutil.copyfile(REPO / "models" / "demo-llama" / name, out / name)
    return out


def worker(*args: str) -> dict:
    proc = subprocess.run([str(PEERS_PY), str(WORKER), *args], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"peers_worker {args[0]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def hf_greedy(prompt: list[int]) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint(), dtype=torch.float32)
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        min_new_tokens=NEW_TOKENS,
    )
    return out[0, len(prompt) :].tolist()


# bench/batch.py's manifest (neffkit's defaults: cpu_kernel auto) with packed prefill, as a
# deployment serving bursts would set it: the 8 prompts arrive at once, and OpenVINO's
# continuous batching prefills them together too
SERVING = MANIFEST.replace("prefill: [32],", "prefill: [32], prefill_batch: [1, 8],")


def neffkit_manifest(dtype: str) -> Path:
    manifest = WORK / f"neffkit-{dtype}.yaml"
    WORK.mkdir(parents=True, exist_ok=True)
    manifest.write_text(SERVING.format(dtype=dtype, model=checkpoint(), kernel="auto"))
    return manifest


def bundle(dtype: str) -> Path:
    return ensure_bundle(neffkit_manifest(dtype), WORK / f"bundle-{dtype}")


def neffkit_build_seconds(dtype: str) -> float:
    manifest = neffkit_manifest(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        env = cold_env(Path(tmp) / "caches")  # cold as on a fresh CI runner, every run
        t0 = time.perf_counter()
        cmd = [
            sys.executable,
            "-m",
            "neffkit",
            "build",
            str(manifest),
            "-o",
            f"{tmp}/b",
            "--no-cache",
        ]
        subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, env=env)
        return time.perf_counter() - t0


def neffkit_runs(dtype: str, repeats: int) -> dict:
    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load
    from neffkit.runtime.sampling_params import SamplingParams

    llm = LLM(load(bundle(dtype)))
    step = median(decode_step_times(llm.core, PROMPTS[:1], NEW_TOKENS))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    rates, tokens = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        seqs = llm.generate(PROMPTS, params)
        rates.append(sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - t0))
    single = llm.generate(PROMPTS[:1], params)[0].output_ids
    tokens = list(single)
    return {"token_s": step, "tokens_per_s": median(rates), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="runs per round inside each system")
    ap.add_argument("--result", default="peers", help="name of the bench/results/*.json written")
    args = parse_args(ap)
    if not PEERS_PY.exists():
        raise SystemExit(f"{PEERS_PY}: missing; run `make peers-venv` first")
    WORK.mkdir(parents=True, exist_ok=True)
    model = peer_model()
    ov_dir = WORK / "openvino"
    ort_dirs = {p: WORK / f"ort-genai-{p}" for p in ("fp32", "bf16")}
    shutil.rmtree(ov_dir, ignore_errors=True)
    builds: dict[str, float] = {"openvino": worker("export-ov", str(model), str(ov_dir))["build_s"]}
    notes = []
    for precision, out in ort_dirs.items():
        shutil.rmtree(out, ignore_errors=True)
        try:
            built = worker("export-ort", str(model), str(out), precision)
            builds[f"ort_genai_{precision}"] = built["build_s"]
        except RuntimeError as exc:
            notes.append(f"ONNX Runtime GenAI {precision}: {str(exc).splitlines()[-1]}")
            ort_dirs.pop(precision)
    for dtype in ("float32", "bfloat16"):
        builds[f"neffkit_{dtype}"] = neffkit_build_seconds(dtype)
    reference = hf_greedy(PROMPTS[0])
    work = json.dumps({"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "repeats": args.repeats})
    systems = {
        "neffkit_fp32": lambda job: neffkit_runs("float32", args.repeats),
        "neffkit_bf16": lambda job: neffkit_runs("bfloat16", args.repeats),
        "openvino_fp32": lambda job: worker("run-ov", str(ov_dir), "f32", job, work),
        "openvino_bf16": lambda job: worker("run-ov", str(ov_dir), "bf16", job, work),
    }
    for precision, out in ort_dirs.items():
        systems[f"ort_genai_{precision}"] = lambda job, out=out, precision=precision: worker(
            "run-ort", str(out), precision, job, work
        )
    samples: dict[str, dict[str, list[float]]] = {s: {"b1": [], "b8": []} for s in systems}
    tokens: dict[str, list[int]] = {}
    failed: set[str] = set()
    for _ in range(args.rounds):  # alternate: the machine's noise hits every system alike
        for system, run in systems.items():
            if system in failed:
                continue
            if system.startswith("neffkit"):
                r = run("both")
                samples[system]["b1"].append(r["token_s"])
                samples[system]["b8"].append(r["tokens_per_s"])
                tokens[system] = r["tokens"]
                continue
            try:
                b1, b8 = run("b1"), run("b8")
            except RuntimeError as exc:  # a peer that builds but cannot run this precision
                notes.append(f"{system}: {str(exc).splitlines()[-1]}")
                failed.add(system)
                continue
            samples[system]["b1"].append(b1["token_s"])
            samples[system]["b8"].append(b8["tokens_per_s"])
            tokens[system] = b1["tokens"]
    rows = {}
    for system, s in samples.items():
        if not s["b1"]:
            continue
        rows[system] = {
            "b1_token_ms": round(1000 * median(s["b1"]), 2),
            "b8_tokens_per_s": round(median(s["b8"]), 1),
            "greedy_equals_hf": tokens[system] == reference,
            "greedy_agreement": round(
                sum(a == b for a, b in zip(tokens[system], reference, strict=False))
                / len(reference),
                3,
            ),
        }
    for precision in ("fp32", "bf16"):
        ours = rows[f"neffkit_{precision}"]
        for peer in ("openvino", "ort_genai"):
            other = rows.get(f"{peer}_{precision}")
            if other is None:
                continue
            ours[f"b1_speedup_vs_{peer}"] = round(other["b1_token_ms"] / ours["b1_token_ms"], 2)
            ours[f"b8_speedup_vs_{peer}"] = round(
                ours["b8_tokens_per_s"] / other["b8_tokens_per_s"], 2
            )
    result = {
        "model": "random Llama, 125M parameters (bench/batch.py's checkpoint)",
        "prompts": len(PROMPTS),
        "new_tokens": NEW_TOKENS,
        "rounds": args.rounds,
        "build_s": {k: round(v, 1) for k, v in builds.items()},
        "systems": rows,
        "notes": notes,
    }
    print(json.dumps(result, indent=2))
    print(f"wrote {write_result(args.result, result)}")


if __name__ == "__main__":
    main()
