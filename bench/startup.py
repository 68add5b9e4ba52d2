"""Process start → first token: a prebuilt bundle vs HF load vs HF + torch.compile warm-up.

Each path runs in a fresh Python subprocess; the time is measured from just before the process is
started to the moment it prints its first generated token (wall clock, both sides). For neffkit the
child also reports how long reading the weights took, so "beyond loading the weights" is visible.

    python bench/startup.py [--manifest manifests/demo.yaml] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, ensure_bundle, parse_args, write_result  # noqa: E402

NEFFKIT = """
import json, sys, time
t0 = time.time()
import torch  # timed alone: the floor of any PyTorch-based runtime
torch_s = time.time() - t0
t0 = time.time()
with open(sys.argv[2] + "/weights/rank0.safetensors", "rb") as f:  # what reading the weights
    while f.read(1 << 24):                                          # alone costs (the runtime
        pass                                                         # maps the file, then pages in)
weights_s = time.time() - t0
from neffkit.runtime.engine.loading import load
from neffkit.runtime.sampling_params import SamplingParams
from neffkit.runtime.engine.llm import LLM
engine = LLM(load(sys.argv[2], verify=True))
seq = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=1, temperature=0.0))[0]
token = seq.output_ids[0]
print(json.dumps({"first_token_at": time.time(), "weights_s": weights_s, "torch_s": torch_s,
                  "token": token}))
"""

INTERPRETER = """
import json, time
print(json.dumps({"first_token_at": time.time()}))
"""
HF = """
import json, sys, time
import torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32)
ids = torch.tensor([[5, 6, 7, 8]])
if sys.argv[3] == "compile":
    model.forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
    out = model.generate(ids, max_new_tokens=1, do_sample=False, cache_implementation="static",
                         attention_mask=torch.ones_like(ids))
else:
    out = model.generate(ids, max_new_tokens=1, do_sample=False,
                         attention_mask=torch.ones_like(ids))
print(json.dumps({"first_token_at": time.time(), "token": int(out[0, -1])}))
"""


def run_child(code: str, *argv: str) -> dict:
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", code, "child", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["seconds"] = result["first_token_at"] - start
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", type=Path, default=REPO / "manifests" / "demo.yaml")
    ap.add_argument("--bundle", type=Path, default=REPO / "bundles" / "demo-llama")
    ap.add_argument("--repeats", type=int, default=3)
    args = parse_args(ap)
    bundle = ensure_bundle(args.manifest, args.bundle)
    model_dir = json.loads((bundle / "bundle.json").read_text())["manifest"]["model"]
    runs: dict[str, list[dict]] = {
        "interpreter": [],
        "neffkit": [],
        "hf_eager": [],
        "hf_compile": [],
    }
    for _ in range(args.repeats):  # interleaved, so drift hits every path alike
        runs["interpreter"].append(run_child(INTERPRETER))
        runs["neffkit"].append(run_child(NEFFKIT, str(bundle)))
        runs["hf_eager"].append(run_child(HF, model_dir, "eager"))
        runs["hf_compile"].append(run_child(HF, model_dir, "compile"))
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
    weights = statistics.median(r["weights_s"] for r in runs["neffkit"])
    torch_s = statistics.median(r["torch_s"] for r in runs["neffkit"])
    rest = statistics.median(r["seconds"] - r["weights_s"] - r["torch_s"] for r in runs["neffkit"])
    interpreter = med.pop("interpreter")
    result = {
        "bundle": str(bundle),
        "median_seconds": med,
        "neffkit_weights_s": weights,
        "neffkit_import_torch_s": torch_s,
        "neffkit_beyond_torch_and_weights_s": rest,
        # a bare `python -c` of this venv: the interpreter and site (the editable-install
        # finder included), paid by any Python runtime before its first import
        "interpreter_s": interpreter,
        "neffkit_beyond_interpreter_torch_and_weights_s": rest - interpreter,
        "neffkit_beyond_weights_s": med["neffkit"] - weights,
        "hf_compile_vs_neffkit": med["hf_compile"] / med["neffkit"],
        "hf_eager_vs_neffkit": med["hf_eager"] / med["neffkit"],
    }
    for k, v in med.items():
        print(f"{k:>11}: {v:.2f} s to the first token")
    print(
        f"neffkit: import torch {torch_s:.2f} s, weights {weights:.3f} s, everything else "
        f"{rest:.3f} s, of which the bare interpreter {interpreter:.3f} s"
    )
    print(
        f"neffkit beyond reading the weights: {result['neffkit_beyond_weights_s']:.2f} s; "
        f"HF+torch.compile is {result['hf_compile_vs_neffkit']:.1f}x slower"
    )
    print(f"written {write_result('startup', result)}")


if __name__ == "__main__":
    main()
