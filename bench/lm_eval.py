"""lm-eval against `neffkit run`: a multiple-choice task written for the repo through the server,
checked against HF transformers computing the same loglikelihoods.

    make lm-eval            # SmolLM2-135M-Instruct, 50 general-knowledge questions
    .venv/bin/python bench/lm_eval.py --demo    # the toy model, 20 Python fill-ins

lm-eval (`lm_eval --model local-completions`) scores each choice with one request of the shape
its loglikelihood path sends: the context + continuation token ids, `echo: true`,
`logprobs: 1`, `max_tokens: 1`; it reads the continuation's prompt logprobs and whether each
token was the greedy one. lm-eval lives in a venv of its own (`.venv-lmeval`, made by
`make lm-eval`), as the CPU peers do: its pins are not neffkit's. The oracle is HF's forward on
the same token ids: the summed log-softmax of each choice, its argmax per document. Writes
bench/results/lm_eval_smollm2.json (--demo: lm_eval.json).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, ensure_bundle, write_result  # noqa: E402

TASKS_DIR = REPO / "eval" / "tasks"
LM_EVAL = REPO / ".venv-lmeval" / "bin" / "lm_eval"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(bundle: Path, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "neffkit",
        "run",
        str(bundle),
        "--port",
        str(port),
        "--served-model-name",
        "demo",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.terminate()
    raise SystemExit("the server did not become healthy in 120 s")


def run_lm_eval(task: str, port: int, tokenizer: Path, out: Path) -> dict[str, Any]:
    """lm_eval through the server; returns its results and logged samples."""
    model_args = ",".join(
        [
            "model=demo",
            f"base_url=http://127.0.0.1:{port}/v1/completions",
            f"tokenizer={tokenizer}",
            "tokenizer_backend=huggingface",
            "num_concurrent=4",
            "max_retries=1",
        ]
    )
    cmd = [
        str(LM_EVAL),
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        task,
        "--include_path",
        str(TASKS_DIR),
        "--output_path",
        str(out),
        "--log_samples",
    ]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    subprocess.run(cmd, check=True, cwd=REPO, env=env)
    results = next(out.rglob("results_*.json"))
    samples = next(out.rglob(f"samples_{task}_*.jsonl"))
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return {"results": json.loads(results.read_text()), "samples": rows}


def hf_loglikelihoods(model_dir: Path, tokenizer: Path, docs: list[dict]) -> list[list[float]]:
    """Per document, per choice: the continuation's summed log-softmax under HF's forward, on
    the token ids lm-eval sends (context encoded alone, continuation = the rest of the whole)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    # float32, as the bundle (the checkpoint is stored in bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    scores = []
    for doc in docs:
        # lm-eval's _encode_pair: the context's trailing whitespace moves to the continuation
        text = doc["context"].rstrip()
        space = doc["context"][len(text) :]
        context = tok(text, add_special_tokens=False).input_ids
        row = []
        for choice in doc["choices"]:
            whole = tok(text + space + choice, add_special_tokens=False).input_ids
            ids = torch.tensor([whole])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
            cont = range(len(context), len(whole))
            row.append(sum(logp[i - 1, whole[i]].item() for i in cont))
        scores.append(row)
    return scores


RUNS = {  # what --demo / the default evaluate: task, manifest, bundle, model, result name
    "smollm2": (
        "neffkit_general_mc",
        "smollm2-eval.yaml",
        "smollm2-135m-instruct-eval",
        "smollm2-135m-instruct",
        "lm_eval_smollm2",
    ),
    "demo": ("neffkit_demo_mc", "demo-serve.yaml", "demo-llama-serve", "demo-llama", "lm_eval"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="the toy model and its Python task")
    args = parser.parse_args()
    task, manifest, bundle_name, model_name, result_name = RUNS["demo" if args.demo else "smollm2"]
    model = REPO / "models" / model_name
    if not LM_EVAL.exists():
        raise SystemExit(f"{LM_EVAL} is missing: run `make lm-eval` (it makes the venv)")
    if not (model / "config.json").exists():
        raise SystemExit(f"{model} is missing: `make demo` converts it")
    bundle_dir = REPO / "bundles" / bundle_name
    record = json.loads((bundle_dir / "bundle.json").read_text()) if bundle_dir.exists() else {}
    if not record.get("layout", {}).get("prompt_logprobs"):  # built before prompt logprobs
        subprocess.run(["rm", "-rf", str(bundle_dir)], check=True)
    bundle = ensure_bundle(REPO / "manifests" / manifest, bundle_dir)
    port = _free_port()
    server = start_server(bundle, port)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            got = run_lm_eval(task, port, bundle / "tokenizer", Path(tmp))
            seconds = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(timeout=60)
    samples = sorted(got["samples"], key=lambda s: s["doc_id"])
    docs = [s["doc"] for s in samples]
    served = [[float(r[0][0]) for r in s["resps"]] for s in samples]
    oracle = hf_loglikelihoods(model, bundle / "tokenizer", docs)
    diff = max(
        abs(a - b)
        for sr, hr in zip(served, oracle, strict=True)
        for a, b in zip(sr, hr, strict=True)
    )
    hf_acc = sum(
        max(range(len(r)), key=r.__getitem__) == d["answer"]
        for r, d in zip(oracle, docs, strict=True)
    ) / len(docs)
    acc = got["results"]["results"][task]["acc,none"]
    result = {
        "model": model_name,
        "task": task,
        "documents": len(docs),
        "acc_through_server": acc,
        "acc_hf_oracle": hf_acc,
        "max_loglikelihood_difference": diff,
        "lm_eval_seconds": round(seconds, 1),
        "lm_eval_version": got["results"].get("lm_eval_version"),
    }
    print(json.dumps(result, indent=2))
    write_result(result_name, result)
    for doc, sr, hr in zip(docs, served, oracle, strict=True):
        if max(abs(a - b) for a, b in zip(sr, hr, strict=True)) > 1e-3:
            print(f"differs: {doc['context']!r}: server {sr}, HF {hr}")
    if acc != hf_acc or diff > 1e-3:
        raise SystemExit("the server's loglikelihoods disagree with HF's")


if __name__ == "__main__":
    main()
