"""neffkit against llama.cpp on SmolLM2-135M-Instruct: the same weights, the same run.

llama.cpp is built from the tree `llama-cpp-python==0.3.36`'s sdist vendors (`vendor/llama.cpp`,
cmake, `GGML_NATIVE=ON`: AVX-512, VNNI and bf16 where the CPU has them, OpenMP), and the
HF-format checkpoint `make demo` converts (models/smollm2-135m-instruct) goes through its
`convert_hf_to_gguf.py` into f32, bf16 and Q8_0 GGUFs, in a venv of its own (the converter pins
transformers 4.57). neffkit builds float32, bfloat16 and block-fp8 (128x128,
tools/make_fp8_model.py) bundles of the same checkpoint, with packed prefill; the fp8 one
quantizes its LM head too (`lm_head: {dtype: float8_e4m3fn}`), as Q8_0 quantizes its output
tensor. Both sides run 2 threads.

Reported, rounds alternating the systems, medians:
- batch 1: ms per token (llama.cpp: `llama-bench -p 0 -n 64`; neffkit: the median decode step);
- batch 8: 8 prompts of 4 tokens, 48 new tokens each, end to end, output tokens/s
  (`llama-batched-bench -npp 4 -ntg 48 -npl 8`; neffkit: `LLM.generate`);
- serving: `llama-server -np 8` against `neffkit run`, 1 and 8 streams of bench/serve.py's client
  (32-token prompts, 64 tokens out, greedy, ignore_eos);
- greedy tokens of both against HF transformers (float32) on chat prompts, up to EOS.

Writes bench/results/llamacpp.json (`--result llamacpp_intel`: a second host's figures kept
beside the first's). Everything is fetched and built under bench/work/llamacpp
once (the llama.cpp build takes ~15 min on 2 cores).

This script times the batch-1 and batch-8 figures and writes the result; building llama.cpp, the
GGUFs and the bundles is bench/llamacpp_build.py's, the two servers bench/llamacpp_server.py's,
the greedy comparison bench/llamacpp_greedy.py's.

    make llamacpp  # or: .venv/bin/python bench/llamacpp.py [--rounds 3] [--skip-serve] [--result N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, decode_step_times, median, parse_args, write_result  # noqa: E402
from llamacpp_build import (  # noqa: E402
    COMMIT,
    KINDS,
    MODEL,
    SDIST,
    THREADS,
    binaries,
    gguf,
    guarded,
    neffkit_bundle,
    run,
    threads,
)
from llamacpp_greedy import greedy_against_hf  # noqa: E402
from llamacpp_server import serving  # noqa: E402

PROMPTS = [[5 + i, 6, 7, 8] for i in range(8)]  # bench/peers.py's batch-8 work
NEW_TOKENS = 48
B1_TOKENS = 64


# ------------------------------------------------------------------ the measurements
def llama_b1_ms(binary: Path, model: Path) -> float:
    out = run(
        [binary, "-m", model, "-p", "0", "-n", B1_TOKENS, "-t", threads(), "-r", "1", "-o", "json"],
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)[0]["avg_ns"] / B1_TOKENS / 1e6


def llama_b8_tokens_per_s(binary: Path, model: Path) -> float:
    out = run(
        [
            binary,
            "-m",
            model,
            "-c",
            "1024",
            "-b",
            "512",
            "-ub",
            "512",
            "-npp",
            "4",
            "-ntg",
            NEW_TOKENS,
            "-npl",
            len(PROMPTS),
            "-t",
            threads(),
            "--output-format",
            "jsonl",
        ],
        capture_output=True,
        text=True,
    ).stdout
    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return row["pl"] * row["tg"] / row["t"]  # output tokens, as neffkit's figure counts


def neffkit_b1_ms(llm: Any) -> float:
    return 1000 * median(decode_step_times(llm.core, PROMPTS[:1], B1_TOKENS))


def neffkit_b8_tokens_per_s(llm: Any) -> float:
    from neffkit.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    seqs = llm.generate(PROMPTS, params)
    return sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - t0)


# ------------------------------------------------------------------ the run
def one_round(
    bins: dict[str, Path], kind: str, model: Path, llm: Any, failures: dict[str, str]
) -> dict[tuple[str, str], float | None]:
    """Each figure once, llama.cpp and neffkit alternating."""
    bench, batched = bins["llama-bench"], bins["llama-batched-bench"]
    return {
        ("llamacpp", "b1"): guarded(
            failures, f"{KINDS[kind]} b1", lambda: llama_b1_ms(bench, model)
        ),
        ("neffkit", "b1"): neffkit_b1_ms(llm),
        ("llamacpp", "b8"): guarded(
            failures, f"{KINDS[kind]} b8", lambda: llama_b8_tokens_per_s(batched, model)
        ),
        ("neffkit", "b8"): neffkit_b8_tokens_per_s(llm),
    }


def _median(samples: dict[tuple[str, str, str], list[float]], *key: str) -> float | None:
    return median(samples[key]) if key in samples else None  # none: llama.cpp died on each


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--result", default="llamacpp", help="name of the bench/results/*.json written")
    args = parse_args(ap, default_threads=THREADS)
    import torch

    from neffkit.runtime.engine.llm import LLM
    from neffkit.runtime.engine.loading import load

    if not (MODEL / "config.json").exists():
        raise SystemExit(f"{MODEL.relative_to(REPO)}: missing; `make demo` converts it")
    bins = binaries()
    ggufs = {kind: gguf(outtype) for kind, outtype in KINDS.items()}
    bundles = {kind: neffkit_bundle(kind) for kind in KINDS}
    torch.set_num_threads(threads())
    llms = {kind: LLM(load(path)) for kind, path in bundles.items()}
    samples: dict[tuple[str, str, str], list[float]] = {}
    failures: dict[str, str] = {}
    for r in range(args.rounds):  # alternate: the machine's noise hits both alike
        for kind in KINDS:
            for key, value in one_round(bins, kind, ggufs[kind], llms[kind], failures).items():
                if value is not None:
                    samples.setdefault((kind, *key), []).append(value)
        print(
            f"round {r + 1}: "
            + ", ".join(f"{'/'.join(k)} {v[-1]:.2f}" for k, v in samples.items()),
            flush=True,
        )
    rows = {}
    for kind, outtype in KINDS.items():
        ours_b1, theirs_b1 = (_median(samples, kind, s, "b1") for s in ("neffkit", "llamacpp"))
        ours_b8, theirs_b8 = (_median(samples, kind, s, "b8") for s in ("neffkit", "llamacpp"))
        rows[kind] = {
            "llamacpp_type": outtype,
            "neffkit_b1_ms": _round(ours_b1, 2),
            "llamacpp_b1_ms": _round(theirs_b1, 2),
            "b1_speed_relative": theirs_b1 and _round(theirs_b1 / ours_b1, 3),
            "neffkit_b8_tokens_per_s": _round(ours_b8, 1),
            "llamacpp_b8_tokens_per_s": _round(theirs_b8, 1),
            "b8_speed_relative": theirs_b8 and _round(ours_b8 / theirs_b8, 3),
        }
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (models/smollm2-135m-instruct)",
        "llama_cpp": f"{SDIST} vendor/llama.cpp ({COMMIT}), GGML_NATIVE=ON",
        "threads": threads(),
        "rounds": args.rounds,
        "b8_work": f"{len(PROMPTS)} prompts x (4 tokens + {NEW_TOKENS} new)",
        "rows": rows,
        "greedy_vs_hf": greedy_against_hf(llms, bins["llama-server"], ggufs, failures),
        "llamacpp_failures": failures,
    }
    write_result(args.result, result)  # the offline figures, whatever serving does
    if not args.skip_serve:
        del llms  # the servers load their own copies
        result["serving"] = {
            kind: serving(kind, bundles[kind], bins["llama-server"], ggufs[kind], args)
            for kind in ("float32", "bfloat16")
        }
    print(json.dumps(result, indent=2))
    print(f"written {write_result(args.result, result)}")


if __name__ == "__main__":
    main()
